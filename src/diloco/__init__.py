"""diloco: low-communication training of language models (DiLoCo, asynchronous Local-SGD).

Library use, around your own model and data (see README.md for a runnable example):

    from diloco import DiLoCo, Nesterov
    trainer = DiLoCo(make_model, make_inner_opt, batch_iterators, inner_steps=50,
                     loss_fn=my_loss, outer_opt=Nesterov(lr=0.7, momentum=0.9))
    for _ in range(rounds):
        trainer.round()          # trainer.model holds the global parameters

Across processes, in your own loop (torchrun; README.md has a whole script):

    outer = DistributedDiLoCo(model, inner_steps=50, outer_opt=Nesterov(lr=0.7, momentum=0.9))
    ...                          # after each inner optimizer step:
    outer.step()                 # every 50th call: the outer step across the processes

Compressed outer_grads and Streaming DiLoCo (docs/communication.md): pass
`codec=build_codec("fp4", error_feedback=True)` and `fragments=4, overlap_steps=5` to DiLoCo or
DistributedDiLoCo; `dylu=True` to DistributedDiLoCo for workers of different speeds.
"""

from diloco import _before_torch  # noqa: F401  (first: it may set what PyTorch reads once)
from diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, TrainConfig
from diloco.core.async_rules import AsyncRule, DelayedNesterov, build_async_rule
from diloco.core.codec import Codec, Fp32Codec, build_codec
from diloco.core.inner import InnerResult, Worker
from diloco.core.outer import SGD, Adam, Nesterov, OuterOpt, weighted_average
from diloco.errors import UserError
from diloco.model.gpt import GPT
from diloco.run.train import train
from diloco.runtime import RoundStats
from diloco.runtime.async_sim import AsyncDiLoCo
from diloco.runtime.clock import Clock
from diloco.runtime.data_parallel import DataParallel
from diloco.runtime.distributed import DistributedDiLoCo
from diloco.runtime.pool import InlinePool
from diloco.runtime.sim import DiLoCo, make_worker

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "AsyncDiLoCo",
    "AsyncRule",
    "Clock",
    "DelayedNesterov",
    "InlinePool",
    "build_async_rule",
    "build_codec",
    "make_worker",
    "SGD",
    "Adam",
    "Codec",
    "DataConfig",
    "DataParallel",
    "DiLoCo",
    "DistributedDiLoCo",
    "Fp32Codec",
    "InnerConfig",
    "InnerResult",
    "ModelConfig",
    "Nesterov",
    "OuterConfig",
    "OuterOpt",
    "RoundStats",
    "TrainConfig",
    "UserError",
    "Worker",
    "train",
    "weighted_average",
]
