"""The worker's flags (Config): every setting `pagedserve worker` takes, checked before anything starts."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.services import config_fields as cf
from pagedserve.services.config_fields import at_least, positive
from pagedserve.services.flags import ProcessConfig, opt

HEARTBEAT_S = 1.0    # rank 0 -> others when idle; must stay well under Config.dist_timeout_s


@dataclass
class Config(cf.GrammarOptions, ProcessConfig):
    model: str = cf.model()
    rank: int = opt(0, "tensor-parallel rank of this process", check=at_least(0))
    tp_size: int = opt(1, "tensor-parallel ranks in the group", check=at_least(1))
    dist_init: str = opt("tcp://127.0.0.1:29500", "torch.distributed init method (--tp-size > 1)",
                         check=lambda v: v.startswith(("tcp://", "file://")) or "must be a tcp:// or file:// address")
    dist_timeout_s: float = opt(60.0, "seconds to join the group, and for any one collective", flag="--dist-timeout",
                                check=lambda v: v > HEARTBEAT_S * 5 or f"must be above {HEARTBEAT_S * 5:g} s")
    endpoint: str = cf.endpoint("tcp://127.0.0.1:5603", "where rank 0 serves steps")
    kvstore_endpoint: str = cf.endpoint("tcp://127.0.0.1:5601", "the kvstore's endpoint")
    kvstore_timeout_s: float = opt(10.0, "seconds to wait for the kvstore", flag="--kvstore-timeout", check=positive)
    device: str = cf.device()
    dtype: str = cf.dtype()
    block_size: int = cf.block_size()              # must equal the kvstore's
    profile_tokens: int = opt(2048, "tokens of the start-up profiling step (the scheduler's "
                                    "--max-num-batched-tokens)", check=at_least(1))
    profile_seqs: int = opt(256, "sequences of the start-up profiling step (the scheduler's --max-num-seqs)",
                            check=at_least(1))
    enforce_eager: bool = cf.enforce_eager()
    launch_ahead: str = opt("auto", "launch a step the scheduler planned ahead before answering the one before "
                                    "it. auto: on CUDA, where a launch returns before the device is done; on "
                                    "CPU a launch computes the step, and answering first is sooner",
                            choices=("auto", "on", "off"))
    torch_threads: int = opt(0, "torch threads (0: torch's default)", check=at_least(0))
    seed: int = cf.seed()
    log_level: str = cf.log_level()
    # Supervision (services/heartbeat.py): rank 0 answers Pings here with whether its main thread
    # moved (a step's layers tick) within hang_timeout_s. None: no heartbeat.
    heartbeat_endpoint: str | None = cf.optional_endpoint("rank 0 answers heartbeat Pings here (the launcher and "
                                                          "the scheduler watch it)")
    hang_timeout_s: float = cf.hang_timeout("seconds without progress after which the heartbeat reports this "
                                            "worker stuck")
    curve_keys: str = cf.curve_keys("required to listen on a non-loopback address")

    def cross_check(self) -> str | None:
        if not self.rank < self.tp_size:
            return f"--rank must be in [0, --tp-size={self.tp_size}), got {self.rank}"
        return None

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.rank}" if self.device == "cuda" else self.device
