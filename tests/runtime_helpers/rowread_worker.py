"""A torchrun worker for ``RowRead``: every rank saves its part of a 1-D vector of 30
entries and of a 20 × 4 table with DCP, then reads some row ranges of each back.

argv[1]: the directory. Each rank writes ``rank<r>.json``: whether every value read
is right, how many values it read and how many it asked for."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

#: What each rank reads (half-open ranges, some overlapping): of the vector, of the table.
WANT = {0: ([(0, 3), (2, 5), (20, 22)], [(4, 6)]), 1: ([(29, 30)], [(0, 1), (10, 20)])}


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    from shardwise.runtime.optstate import RowRead, merge_ranges

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(sys.argv[1])
    vector = torch.arange(30, dtype=torch.float32)
    table = torch.arange(80, dtype=torch.float32).view(20, 4)
    lo, hi = (0, 15) if rank == 0 else (15, 30)
    shard = Shard(vector[lo:hi].clone(), ShardMetadata([lo], [hi - lo], f"rank:{rank}/cpu"))
    saved = init_from_local_shards([shard], [30])
    save({"v": saved, "t": table}, checkpoint_id=out / "ckpt")
    vec_ranges, table_ranges = WANT[rank]
    v = RowRead([30], torch.float32, vec_ranges)
    t = RowRead([20, 4], torch.float32, table_ranges)
    load({"v": v.request, "t": t.request}, checkpoint_id=out / "ckpt")
    ok = all(torch.equal(v.rows(a, b), vector[a:b]) for a, b in vec_ranges) and all(
        torch.equal(t.rows(a, b), table[a:b]) for a, b in table_ranges
    )
    wanted = sum(b - a for a, b in merge_ranges(vec_ranges)) + 4 * sum(
        b - a for a, b in merge_ranges(table_ranges)
    )
    report = {"ok": ok, "elements": v.elements + t.elements, "wanted": wanted}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
