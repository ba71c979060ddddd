"""Every sharding kind on the worker: what runs (trained against an unsharded copy) and
what is refused before any collective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers.kinds_worker import batch, loss_of
from test_runtime_torchrun import TORCHRUN, _env, run
from torchrec import EmbeddingBagCollection

from shardwise.basics import UserError
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, PlanTable, Shard, save_plan
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import embedding_bag_configs
from shardwise.runtime.env import WorkerEnv
from shardwise.runtime.plancheck import load_worker_plan, plan_problems, run_problems
from shardwise.runtime.sharding import all_kinds_sharder
from shardwise.runtime.stop import GracefulStop
from shardwise.runtime.trainer import train

HELPER = Path(__file__).parent / "runtime_helpers" / "kinds_worker.py"
LR = 0.1
EPS = 1e-8


def rows(rows: int, ranks: list[int], cols: int, col_offset: int = 0) -> list[Shard]:
    """TorchRec's even row cut of ``rows`` over ``ranks`` (one column range)."""
    return [
        Shard(rank=r, col_offset=col_offset, cols=cols, row_offset=o, rows=n)
        for r, (o, n) in zip(ranks, even_row_split(rows, len(ranks)), strict=True)
    ]


def every_kind(world: int = 4, per_host: int | None = 2) -> Plan:
    """One table of each kind on ``world`` ranks in hosts of ``per_host``."""
    local = per_host or world
    first, last = list(range(local)), list(range(world - local, world))
    tables = [
        PlanTable(name="tw", rows=20, dim=8, shards=[Shard(rank=world - 1, cols=8)]),
        PlanTable(
            name="cw",
            rows=12,
            dim=16,
            shards=[Shard(rank=1, cols=8), Shard(rank=world - 2, col_offset=8, cols=8)],
        ),
        PlanTable(name="rw", rows=21, dim=8, kind="row_wise", shards=rows(21, [*range(world)], 8)),
        PlanTable(name="twrw", rows=13, dim=8, kind="table_row_wise", shards=rows(13, last, 8)),
        PlanTable(
            name="grid",
            rows=11,
            dim=16,
            kind="grid",
            shards=rows(11, first, 8) + rows(11, last, 8, 8),
        ),
        PlanTable(
            name="dp",
            rows=9,
            dim=8,
            kind="data_parallel",
            shards=[Shard(rank=r, cols=8) for r in range(world)],
        ),
    ]
    topo = Topology(gpus=world, gpu_memory_bytes=2**30, device="cpu", gpus_per_host=per_host)
    plan = Plan(world_size=world, planner="test", topology=topo, tables=tables).with_hash()
    assert plan.problems() == [], plan.problems()
    return plan


def specs_of(plan: Plan) -> list[TableSpec]:
    return [
        TableSpec(name=t.name, rows=t.rows, dim=t.dim, pooling_factor=1.0, dtype=t.dtype)
        for t in plan.tables
    ]


# --------------------------------------------------------------------------- refused


def test_the_sharder_offers_every_kind_on_cpu() -> None:
    offered = set(all_kinds_sharder({}).sharding_types("cpu"))
    assert {"row_wise", "table_row_wise", "grid_shard", "data_parallel"} <= offered
    assert {"table_wise", "column_wise"} <= offered


def test_host_kinds_need_the_plans_ranks_per_host() -> None:
    plan = every_kind(4, 2)
    assert run_problems(plan, 2) == []
    (problem,) = run_problems(plan, 4)
    assert "2 GPUs per host" in problem and "4 ranks per host" in problem
    assert "'twrw', 'grid'" in problem and "--gpus-per-host 4" in problem
    flat = every_kind(4, None)  # one host of 4: TorchRec must see 4 local ranks
    assert run_problems(flat, 4) == [] and run_problems(flat, 2) != []
    # without host kinds the ranks per host do not matter
    tw = plan.model_copy(update={"tables": plan.tables[:3]}).with_hash()
    assert run_problems(tw, 1) == []


def test_uneven_row_cuts_and_fp16_data_parallel_are_refused() -> None:
    plan = every_kind(2, None)
    rw = next(t for t in plan.tables if t.name == "rw")
    rw.shards = [  # 21 rows as 10 + 11: TorchRec would send ids 10 to rank 0
        Shard(rank=0, cols=8, row_offset=0, rows=10),
        Shard(rank=1, cols=8, row_offset=10, rows=11),
    ]
    dp = next(t for t in plan.tables if t.name == "dp")
    dp.dtype = "fp16"
    plan = plan.with_hash()
    assert plan.problems() == []  # plan.json allows both
    found = run_problems(plan, 2)
    assert any("'rw'" in p and "even cut" in p for p in found)
    assert any("'dp' is data_parallel in fp16" in p and "NaN" in p for p in found)
    assert len(found) == 2
    assert plan_problems(plan, specs_of(plan), 2) == found  # what the worker checks


def test_the_worker_refuses_before_any_collective(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = every_kind(2, 2)
    save_plan(plan, tmp_path / "plan.json")
    specs = specs_of(plan)
    env = WorkerEnv.from_environ(
        {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "1", "SHARDWISE_PLAN": "x"}
    )
    with pytest.raises(UserError, match="2 GPUs per host .* 1 ranks per host"):
        load_worker_plan(specs, env, tmp_path / "plan.json")
    save_tables(specs, tmp_path / "tables.yaml")
    for name, value in {
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "SHARDWISE_PLAN": str(tmp_path / "plan.json"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SHARDWISE_PLAN_HASH", raising=False)

    def never(*_: object) -> object:
        raise AssertionError("called before the plan was checked")

    code = train(tmp_path / "tables.yaml", never, never, stop=GracefulStop(bound=0))  # type: ignore[arg-type]
    assert code == 2
    assert "[rank 1/2] error:" in capsys.readouterr().err


# --------------------------------------------------------------------------- trained


def _reference(plan: Plan, start: dict[str, torch.Tensor], steps: int) -> dict[str, torch.Tensor]:
    """The unsharded model trained as DMP trains the plan: every rank's loss, the
    gradient averaged over the ranks (DDP for data-parallel tables, TorchRec's
    backward for the others); Adagrad for data-parallel tables, row-wise Adagrad with
    one accumulator per row and column range for the others."""
    configs = embedding_bag_configs(plan.tables)
    model = EmbeddingBagCollection(configs, device=torch.device("cpu"))
    model.load_state_dict({k.removeprefix("ebc."): v for k, v in start.items()})
    kinds = {t.name: t for t in plan.tables}
    params = dict(model.named_parameters())
    dp = [p for n, p in params.items() if kinds[n.split(".")[-2]].kind == "data_parallel"]
    adagrad = torch.optim.Adagrad(dp, lr=LR)
    sums: dict[str, torch.Tensor] = {}
    for step in range(1, steps + 1):
        model.zero_grad()
        loss = sum(
            loss_of(model(batch(plan.tables, r, step)), plan.tables) for r in range(plan.world_size)
        )
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        with torch.no_grad():
            for p in params.values():
                assert p.grad is not None
                p.grad /= plan.world_size
            adagrad.step()
            for name, p in params.items():
                table = kinds[name.split(".")[-2]]
                if table.kind == "data_parallel":
                    continue
                assert p.grad is not None
                for c, w in sorted({(s.col_offset, s.cols) for s in table.shards}):
                    g = p.grad[:, c : c + w]
                    acc = sums.setdefault(f"{name}:{c}", torch.zeros(table.rows))
                    acc += g.pow(2).mean(dim=1)
                    p[:, c : c + w] -= LR * g / (acc.sqrt() + EPS)[:, None]
    return {f"ebc.{k}": v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_every_kind_trains_like_an_unsharded_model_on_two_cpu_hosts(tmp_path: Path) -> None:
    """4 gloo ranks as 2 hosts of 2: table-wise, column-wise, row-wise over all 4,
    table-row-wise on host 1, grid over both hosts and data-parallel, 3 steps of
    row-wise Adagrad (and Adagrad for the data-parallel table, trained by the dense
    optimizer despite FBGEMM's CPU warning): every table equals the reference."""
    plan = every_kind(4, 2)
    save_plan(plan, tmp_path / "plan.json")
    steps = 3
    cmd = [
        *TORCHRUN,
        "--nproc_per_node=4",
        HELPER,
        "plan.json",
        "out.pt",
        str(steps),
        "rowwise_adagrad",
        str(LR),
        "2",
    ]
    proc = run(cmd, _env(PYTHONPATH=str(Path(__file__).parent)), tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = torch.load(tmp_path / "out.pt")
    want = _reference(plan, out["start"], steps)
    for key, value in want.items():
        assert not torch.equal(value, out["start"][key]), f"{key} did not train"
        err = float((out["end"][key] - value).abs().max())
        assert err < 1e-5, (key, err)
