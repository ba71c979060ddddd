"""Workers that grow and shrink in place, through Kueue's elastic workload slices.

A queued DLRMJob that may reshard between two sizes (``workers.min < workers.max``,
resharding on, the default training command) gets an *elastic* worker Job: annotated
``kueue.x-k8s.io/elastic-job: "true"``, so that where the installed Kueue has
``ElasticJobsViaWorkloadSlices`` on, the operator can change the Job's parallelism
while it runs and Kueue admits the change as a new slice of quota, the old slice
holding its quota until then (docs/resharding.md). Kueue's webhook answers the
annotation with a scheduling gate in the pod template: that is how the operator knows
(``JobState.slices``); without it the Job is replaced on a reshard, as always.

What changes in the pods, so that one pod template serves every world size:

- torchrun runs elastic: ``--nnodes=MIN:MAX`` and restarts allowed. When pods join or
  leave, every node's torchrun stops its workers (they checkpoint at an agreed step,
  :mod:`shardwise.runtime.stop`) and starts them again at the new world size.
- the plans ConfigMap ``<job>-plans`` is mounted instead of one plan: one
  ``plan-<ranks>.json`` per world size the job was run at, which the operator writes
  before it creates or resizes the Job (:class:`PlanCopy`); each rank reads its
  world's (:mod:`shardwise.runtime.plancheck`).
- no plan hash in the template (it would tie the template to one world size): the
  Job's ``shardwise.dev/plan`` annotation names the plan it runs, and the ranks check
  among themselves that they read the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise import names
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.render import container as c

#: The most restarts a worker pod's torchrun makes: each resize restarts the workers
#: once on a node whose ranks stopped for a peer; a worker that keeps failing still
#: fails the pod after this many.
MIN_RESTARTS = 4


def applies(spec: DLRMJobSpec, queue: str) -> bool:
    """The worker Job is elastic: queued, resharding on, room to change size, and the
    default command (a user's own command is run as given, at a fixed size)."""
    return (
        bool(queue)
        and spec.resharding.enabled
        and spec.workers.min < spec.workers.max
        and not spec.template.command
    )


def max_restarts(spec: DLRMJobSpec) -> int:
    return max(MIN_RESTARTS, 2 * spec.workers.max)


def torchrun_args(spec: DLRMJobSpec) -> list[str]:
    """The size arguments of an elastic torchrun (in place of ``--nnodes=N``)."""
    return [
        f"--nnodes={spec.workers.min}:{spec.workers.max}",
        f"--max-restarts={max_restarts(spec)}",
    ]


def adapt(body: dict[str, Any], job_name: str, spec: DLRMJobSpec) -> None:
    """Make a rendered worker Job elastic (see the module docstring), in place: nothing
    in its template names one size."""
    body["metadata"]["annotations"][names.ANN_KUEUE_ELASTIC] = "true"
    template = body["spec"]["template"]
    template["metadata"]["labels"].pop(names.LABEL_PLAN_HASH, None)
    pod = template["spec"]
    container = pod["containers"][0]
    mine = (names.ENV_PLAN, names.ENV_PLAN_HASH, names.ENV_NNODES)
    env = [e for e in container["env"] if e["name"] not in mine]
    container["env"] = [
        {"name": names.ENV_PLAN, "value": names.PLAN_DIR},
        {"name": names.ENV_ELASTIC, "value": "1"},
        {"name": names.ENV_NNODES, "value": f"{spec.workers.min}:{spec.workers.max}"},
        *env,
    ]
    for volume in pod["volumes"]:
        if volume["name"] == c.PLAN_VOLUME:
            volume["configMap"] = {"name": names.plans_configmap_name(job_name)}


def is_elastic(job_body: dict[str, Any]) -> bool:
    """A worker Job rendered elastic (:func:`adapt`)."""
    annotations = job_body.get("metadata", {}).get("annotations") or {}
    return annotations.get(names.ANN_KUEUE_ELASTIC) == "true"


def resize_patch(workers: int, plan_configmap: str) -> dict[str, Any]:
    """The Job grown or shrunk in place: Kueue reads the new count as a new slice (a
    larger one) or a smaller admission. ``completions`` moves with ``parallelism``, as
    the API server requires of an Indexed Job."""
    return {
        "metadata": {
            "annotations": {names.ANN_WORKERS: str(workers), names.ANN_PLAN: plan_configmap}
        },
        "spec": {"parallelism": workers, "completions": workers},
    }


@dataclass(frozen=True)
class PlanCopy:
    """Copy the plan of ConfigMap ``source`` into the job's plans ConfigMap as
    ``plan-<ranks>.json`` (with the tables), before the Job that reads it is made or
    resized: the applier reads the source (the decision does not hold plan bodies)."""

    source: str
    ranks: int
