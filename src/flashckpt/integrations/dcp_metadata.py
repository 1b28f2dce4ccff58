"""Reading a DCP checkpoint without running code from it: its ``.metadata``, then its tensors
(:func:`load_dcp`, which ``flashckpt import`` and ``dcp_layout.import_dcp`` both use).

``torch.distributed.checkpoint`` stores its metadata as a pickle and loads it with
``pickle.load``, which runs whatever the file tells it to. flashckpt never does: it reads the
file with a restricted unpickler that can build only DCP's own metadata classes (the dataclasses
and enum of ``torch.distributed.checkpoint.metadata``, the file reader's ``_StorageInfo``),
``torch.Size``, torch dtypes and layouts and ``pathlib`` paths, the way ``torch.load(...,
weights_only=True)`` restricts a ``torch.save`` file, and refuses anything else with a
:class:`~flashckpt.errors.ConfigError`. The storage records it finds must then name plain data
files inside the checkpoint directory. This is only used with an explicit ``--format dcp``:
format detection never picks a pickled format.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle  # restricted: see _RestrictedUnpickler.find_class
import warnings
from pathlib import Path
from typing import Any

import torch

from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.store.files import safeopen

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 256 << 20
_UNREAD = "<flashckpt: not read>"  # a placeholder DCP plans a read for (None it drops)
SINGLE_PROCESS = ".*assuming the intent is to (save|load) in a single process"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_METADATA: {
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "Metadata",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not a DCP metadata class; flashckpt does not load it"
        )


def read_metadata(src: str | os.PathLike[str]) -> Any:
    """The ``Metadata`` of the DCP checkpoint directory ``src``, read without running code."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = Path(src) / ".metadata"
    try:
        data = safeopen.read_file(src, ".metadata", max_bytes=MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{src} has no .metadata file: it is not a DCP checkpoint") from None
    except (OSError, FlashCkptError) as exc:
        raise ConfigError(f"cannot read {where}: {exc}") from None
    try:
        md = _RestrictedUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise ConfigError(f"{where} is refused: {exc}; import only DCP checkpoints") from None
    except Exception as exc:  # a damaged pickle fails in many ways, none of them ours
        raise ConfigError(
            f"{where} is not a readable DCP metadata file ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", 0), dict):
        raise ConfigError(f"{where} does not hold DCP Metadata (found {type(md).__name__})")
    _check_storage(Path(src), md, where)
    return md


def _check_storage(src: Path, md: Any, where: Path) -> None:
    """Every data record must point into a regular file directly inside ``src``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise ConfigError(f"{where}: storage_data is not a mapping")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (
            not isinstance(rel, str)
            or "/" in rel
            or rel in ("", ".", "..")
            or not all(isinstance(v, int) and v >= 0 for v in (offset, length))
            or not safeopen.is_regular(src, rel)
        ):
            raise ConfigError(
                f"{where}: a storage record names {rel!r} (offset {offset!r}, length "
                f"{length!r}), not a data file inside {src}; refusing to read it"
            )
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        size = getattr(item, "size", None)
        if not (isinstance(size, torch.Size) and all(isinstance(d, int) and d >= 0 for d in size)):
            raise ConfigError(f"{where}: entry {fqn!r} has an invalid size {size!r}")
        if not isinstance(getattr(getattr(item, "properties", None), "dtype", None), torch.dtype):
            raise ConfigError(f"{where}: entry {fqn!r} has no torch dtype")


def safe_reader(src: str | os.PathLike[str]) -> Any:
    """A ``FileSystemReader`` for ``src`` whose ``read_metadata`` is the restricted one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = read_metadata(src)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _SafeReader(str(src))


def load_dcp(src: str | os.PathLike[str], *, values: bool = False) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint, keyed by its flattened DCP name. Its metadata is read
    with the restricted unpickler (:func:`~flashckpt.integrations.dcp_metadata.read_metadata`).

    DCP stores every other value (learning rates, step counters, a dataloader's bytes) as a
    ``torch.save`` blob. With ``values=True`` those are read too, each with
    ``torch.load(..., weights_only=True)`` (plain Python values and tensors only, no code runs);
    otherwise, and for a blob that holds anything else, they are left out and named in one
    summary line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not Path(src).is_dir():
        raise ConfigError(f"DCP checkpoint {src} is not a directory")
    metadata = read_metadata(src)
    state: dict[str, Any] = {}
    skipped: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            check_fits(fqn, md.size, md.properties.dtype, src)
            state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        elif values:
            state[fqn] = _UNREAD  # filled by _ValuePlanner.load_bytes
        else:
            skipped.append(fqn)
    if not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"DCP checkpoint {src} holds no tensors")
    planner = _value_planner(skipped)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS)
            dcp.load(state, storage_reader=safe_reader(src), planner=planner, no_dist=True)
    except FlashCkptError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"cannot read the DCP checkpoint {src}: {type(exc).__name__}: {exc}"
        ) from None
    for fqn in [k for k, v in state.items() if v is _UNREAD]:
        del state[fqn]
    if skipped:
        shown = ", ".join(sorted(skipped)[:3])
        log.warning(
            "import: left out %d DCP value entries that are not tensors (%s%s)",
            len(skipped),
            shown,
            ", ..." if len(skipped) > 3 else "",
        )
    return state


def _value_planner(skipped: list[str]) -> Any:
    """DCP's load planner, reading value blobs with ``weights_only=True`` (never unpickling
    code); a blob it refuses is appended to ``skipped``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _ValuePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except Exception:  # not plain data: left out, named in the summary line
                skipped.append(fqn)
                return
            # the dict dcp.load was given (self.state_dict may be a flattened copy of it)
            self.original_state_dict[fqn] = self.state_dict[fqn] = loaded

    return _ValuePlanner(flatten_state_dict=False)


def check_fits(key: str, size: Any, dtype: torch.dtype, src: Any) -> None:
    from flashckpt.store.format.manifest import machine_memory_bytes

    nbytes = math.prod(size) * torch.empty((), dtype=dtype).element_size()
    if nbytes > machine_memory_bytes():
        raise ConfigError(
            f"DCP entry {key!r} in {src} claims {nbytes} bytes, more than this machine's memory"
        )
