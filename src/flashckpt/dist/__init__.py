"""torch.distributed support; :func:`init_process_group` is the one call meant for users."""

from flashckpt.dist.elastic import init_process_group, restart_count

__all__ = ["init_process_group", "restart_count"]
