"""torchx's `kubernetes` scheduler as pipetransformer's jobs need it: the lifecycle policies each
role declares written into its Volcano tasks, the controller's last words in `torchx status`
(orchestrator/volcano.py). A plugin wins torchx's name clash with its built-in scheduler; roles
that declare no policies get exactly what torchx's own scheduler gives them."""

from typing import Any

from torchx.plugins import register


@register.scheduler(name="kubernetes")
def kubernetes(session_name: str, **kwargs: Any) -> Any:
    from pipetransformer.orchestrator.volcano import create_scheduler

    return create_scheduler(session_name, **kwargs)
