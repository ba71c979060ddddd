"""The worker's plan checks, in-process: environment, plan file, tables, model, hash."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from shardwise.basics import UserError
from shardwise.planner.plan import Plan, Shard, save_plan, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import embedding_bag_configs
from shardwise.runtime.env import WorkerEnv
from shardwise.runtime.plancheck import (
    check_plan,
    load_worker_plan,
    plan_path,
    plan_problems,
)
from shardwise.runtime.sharding import (
    EmbeddingOptimizer,
    check_model,
    embedding_collection,
    model_tables,
)

SPECS = [
    TableSpec(name="a", rows=100, dim=16, pooling_factor=2.0),
    TableSpec(name="b", rows=50, dim=8, pooling_factor=1.0, dtype="fp16"),
]


def _plan(world: int = 2, specs: list[TableSpec] = SPECS) -> Plan:
    topo = Topology(gpus=world, gpu_memory_bytes=2**30, device="cpu")
    return table_wise_plan(specs, [i % world for i in range(len(specs))], topo, "test")


def _env(**env: str) -> WorkerEnv:
    return WorkerEnv.from_environ({"WORLD_SIZE": "2", "RANK": "1", **env})


# --------------------------------------------------------------------------- environment


def test_env_reads_torchrun_and_operator_variables() -> None:
    env = WorkerEnv.from_environ(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "SHARDWISE_PLAN": "/etc/shardwise/plan.json",
            "SHARDWISE_NAMESPACE": "ns",
            "SHARDWISE_JOB": "j",
            "SHARDWISE_METRICS_PORT": "9500",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.namespace, env.job, env.plan_path) == ("ns", "j", "/etc/shardwise/plan.json")
    assert env.rank_metrics_port == 9501  # one endpoint per local rank
    assert env.tag == "[rank 3/4]"


def test_env_defaults_to_one_rank_and_port_9400() -> None:
    env = WorkerEnv.from_environ({})
    assert (env.rank, env.world_size, env.namespace, env.job) == (0, 1, "", "")
    assert env.rank_metrics_port == 9400 and env.plan_path is None and env.plan_hash is None
    assert WorkerEnv.from_environ({"SHARDWISE_METRICS_PORT": "0"}).rank_metrics_port == 0


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"SHARDWISE_METRICS_PORT": "-1"}, "SHARDWISE_METRICS_PORT=-1 must be at least 0"),
        ({"SHARDWISE_METRICS_PORT": "65535"}, "no room"),
    ],
)
def test_bad_environment_is_a_user_error(environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(UserError, match=fragment):
        WorkerEnv.from_environ(environ)


# --------------------------------------------------------------------------- the plan


def test_a_fitting_plan_passes(tmp_path: Path) -> None:
    plan = _plan()
    save_plan(plan, tmp_path / "plan.json")
    env = _env(SHARDWISE_PLAN=str(tmp_path / "plan.json"), SHARDWISE_PLAN_HASH=plan.hash)
    assert load_worker_plan(SPECS, env) == plan
    assert load_worker_plan(SPECS, _env(), tmp_path / "plan.json") == plan  # explicit path


def test_no_plan_variable_says_how_to_get_one() -> None:
    with pytest.raises(UserError, match="SHARDWISE_PLAN is not set.*shardwise plan"):
        plan_path(None, _env())


def test_missing_plan_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such plan file"):
        load_worker_plan(SPECS, _env(SHARDWISE_PLAN=str(tmp_path / "nope.json")))


def test_wrong_world_size_says_both_sizes() -> None:
    with pytest.raises(UserError, match="the plan is for 3 ranks but this job runs 2"):
        check_plan(_plan(world=3), SPECS, 2)


def test_table_mismatches_name_the_table() -> None:
    other = [SPECS[0].model_copy(update={"dim": 32}), SPECS[1]]
    problems = plan_problems(_plan(), other, 2)
    assert any("table 'a' is 100x16 fp32 in the plan but 100x32 fp32" in p for p in problems)
    extra = [*SPECS, TableSpec(name="c", rows=1, dim=4, pooling_factor=1)]
    assert "table 'c' is not in the plan" in plan_problems(_plan(), extra, 2)
    assert "table 'b' is in the plan but not in the tables" in plan_problems(_plan(), SPECS[:1], 2)
    with pytest.raises(UserError, match="no rank re-plans"):
        check_plan(_plan(), other, 2)


def test_hash_must_be_present_intact_and_the_expected_one() -> None:
    unhashed = _plan().model_copy(update={"hash": ""})
    assert any("has no hash" in p for p in plan_problems(unhashed, SPECS, 2))
    edited = _plan()
    edited.tables[0].shards[0] = Shard(rank=1, col_offset=0, cols=16)
    assert any("hash does not match" in p for p in plan_problems(edited, SPECS, 2))
    stale = plan_problems(_plan(), SPECS, 2, expected_hash="f" * 64)
    assert any("SHARDWISE_PLAN_HASH expects ffffffffffff" in p for p in stale)


# --------------------------------------------------------------------------- the model


class _Model(torch.nn.Module):
    def __init__(self, configs: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.sparse_arch = torch.nn.Module()
        self.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(
            configs, device=torch.device("meta")
        )


def test_model_tables_are_read_from_the_collection() -> None:
    model = _Model(embedding_bag_configs(SPECS))
    ebc = embedding_collection(model)
    assert [(t.name, t.rows, t.dim, t.dtype) for t in model_tables(ebc)] == [
        ("a", 100, 16, "fp32"),
        ("b", 50, 8, "fp16"),
    ]
    check_model(_plan(), model)  # fits: no error


def test_model_mismatch_names_the_table() -> None:
    model = _Model(embedding_bag_configs([SPECS[0].model_copy(update={"rows": 99}), SPECS[1]]))
    with pytest.raises(UserError, match="table 'a' is 100x16 fp32 in the plan but 99x16"):
        check_model(_plan(), model)
    with pytest.raises(UserError, match="table 'b' is in the plan but not in the model"):
        check_model(_plan(), _Model(embedding_bag_configs(SPECS[:1])))


def test_collection_path_must_exist() -> None:
    model = _Model(embedding_bag_configs(SPECS))
    with pytest.raises(UserError, match="no EmbeddingBagCollection at 'dense'.*sparse_arch"):
        embedding_collection(model, "dense")
    assert embedding_collection(model.sparse_arch.embedding_bag_collection, "") is not None


def test_fused_optimizer_parameters() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    adagrad = EmbeddingOptimizer("rowwise_adagrad", lr=0.1).fused_params()
    assert adagrad["optimizer"] == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert adagrad["learning_rate"] == 0.1
    assert EmbeddingOptimizer("sgd").fused_params()["optimizer"] == EmbOptimType.EXACT_SGD
