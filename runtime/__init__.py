"""The worker runtime: what runs inside the worker pods the operator creates.

A training script started by ``torchrun`` uses it to

- read the injected plan (``SHARDWISE_PLAN``) and check it against its tables and the
  world size before anything collective happens (:mod:`.plancheck`);
- shard its model with that plan through TorchRec's ``DistributedModelParallel``
  (:mod:`.sharding`), gather or load full weights (:mod:`.weights`);
- checkpoint with ``torch.distributed.checkpoint`` and resume on another world size
  and plan (:mod:`.checkpoint`);
- stop cleanly on SIGTERM: finish the step, checkpoint, exit 0 (:mod:`.stop`, and
  :mod:`.launch`, which keeps ``torchrun``'s own exit status from hiding that);
- export its measured per-rank embedding cost to Prometheus (:mod:`.live_cost`).

:mod:`.trainer` puts all of it around a model and data of the caller's own
(``train(tables, model_factory, data_factory, options)``; ``examples/train_dlrm.py``);
:mod:`.train` is the worker image's default entry (``python -m shardwise.runtime.train``):
TorchRec's DLRM on synthetic data (:mod:`.dlrm`) through the same trainer.

Nothing is imported here on purpose: :mod:`.stop`, :mod:`.env` and :mod:`.plancheck`
load without torch, so a worker installs its signal handler before the seconds it
takes to import torch (see :mod:`.stop` and :mod:`.plancheck` for why that matters).
"""
