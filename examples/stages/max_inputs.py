"""A request **stage** of ext_proc: refuse a request with more inputs than the operator allows.

**When to use it.** A batch of thousands of inputs is one request to a load balancer but thousands of
model calls to a worker. A gateway that serves many small clients may cap the batch a client may send in
one request, and tell it so in OpenAI's error shape, rather than let one batch hold a worker.

**What it sees.** A stage gets the request as ext_proc's pick chain does (``ext_proc.model.RequestView``:
its token count, model, number of inputs, headers, class and tenant), once its tokens are counted. It
answers a :class:`~ext_proc.model.Reply` to refuse it, or None to pass it on. A stage that raises, returns
anything else or runs over its time budget is skipped for that request, and counted
(``inferlb_ext_proc_stage_failures_total``): the request goes on.

**Use it.** Allow its module and add it in ext_proc's configuration (the ``[ext_proc]`` table of
``inferlb up --config FILE``, or ``python -m ext_proc --config FILE``)::

    [ext_proc]
    allowed_policy_modules = ["examples.stages"]

    [[ext_proc.stages]]
    plugin = "examples.stages.max_inputs:MaxInputs"
    params = {max_inputs = 64}
    before = "cache"     # quota, models, cache, admission or decide (the default)
    timeout_ms = 50
"""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.model import Reply, RequestView


class MaxInputs:
    """400 ``too_many_inputs`` for a request of more than ``max_inputs`` inputs."""

    @dataclass(frozen=True)
    class Params:
        max_inputs: int = 2048

        def __post_init__(self) -> None:
            if self.max_inputs < 1:
                raise ValueError("max_inputs must be at least 1")

    name = "max_inputs"

    def __init__(self, params: "MaxInputs.Params") -> None:
        self.max_inputs = params.max_inputs

    def on_request(self, request: RequestView) -> Reply | None:
        if request.inputs <= self.max_inputs:
            return None
        return Reply(400, "too_many_inputs", f"This request has {request.inputs} inputs; this gateway takes at "
                     f"most {self.max_inputs} per request. Split it into several requests.",
                     type="invalid_request_error", param="input")
