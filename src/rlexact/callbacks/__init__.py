"""RL callbacks: probes, corrections and guards as thin Lightning adapters over :mod:`.functional`.

The protocol (hooks the module calls, in list order) is in :mod:`rlexact.callbacks.base`; ``docs/metrics.md``
documents it together with every metric name. Put :class:`MismatchInjection` first, then corrections in the order
they should compose (TIS, then rejection), then probes and guards.
"""

from rlexact.callbacks import functional
from rlexact.callbacks.aggregation import MetricReducer, gather_cat
from rlexact.callbacks.base import RLCallback, rl_callbacks
from rlexact.callbacks.corrections import RejectionSampling, TruncatedIS, correction_callbacks
from rlexact.callbacks.guards import ExactnessError, ExactnessGuard
from rlexact.callbacks.injection import MismatchInjection
from rlexact.callbacks.probes import MismatchProbe, UpdateDirectionProbe
from rlexact.callbacks.samples import SampleLogger
from rlexact.callbacks.shadow import ShadowCorrection, ShadowSpec

__all__ = [
    "ExactnessError",
    "ExactnessGuard",
    "MetricReducer",
    "MismatchInjection",
    "MismatchProbe",
    "RLCallback",
    "RejectionSampling",
    "SampleLogger",
    "ShadowCorrection",
    "ShadowSpec",
    "TruncatedIS",
    "UpdateDirectionProbe",
    "correction_callbacks",
    "functional",
    "gather_cat",
    "rl_callbacks",
]
