"""A step as a Hugging Face model directory: ``from_pretrained(DIR)`` loads it offline.

``flashckpt export ROOT DIR --format hf`` (:func:`export_hf`) writes, from the state entry that
holds the model (``prefix``, default ``"model"``; keys are the model's own ``state_dict`` names):

- ``config.json``: the ``config=`` given (a dict, a ``PretrainedConfig``, a ``config.json`` file
  or a directory holding one), else the config saved with the step: a ``transformers`` model
  entry records its ``config`` in the manifest's ``meta`` at every save (state/capture.py), and
  older checkpoints of the HF ``FlashCkptCallback`` carry it as an ``hf_config`` entry. With no
  config anywhere the export raises :class:`ConfigError` and writes nothing;
- ``generation_config.json``: the model's generation config, when the step carries one;
- ``model.safetensors`` (metadata ``{"format": "pt"}``), or above ``max_shard_size`` (default
  5 GB, as ``save_pretrained``) ``model-0000i-of-0000n.safetensors`` shards and
  ``model.safetensors.index.json`` mapping each tensor to its shard.

The directory appears whole or not at all: it is written under a temporary name beside ``out``
and renamed into place last.

A weight tied to another (``lm_head.weight`` to the embeddings, when the config says
``tie_word_embeddings``) is written once, as ``save_pretrained`` does; ``from_pretrained`` ties
it again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flashckpt.errors import ConfigError
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_object
from flashckpt.units import parse_bytes

log = logging.getLogger(__name__)

CONFIG_ENTRY = "hf_config"
GENERATION_ENTRY = "hf_generation_config"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD = 5 * 10**9
MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB


def config_dict(config: Any) -> dict[str, Any]:
    """``config`` (dict, PretrainedConfig, config.json path or its directory) as a dict."""
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:  # a regular file, its size checked before reading (a FIFO or /dev/zero is refused)
        data = safeopen.read_path(path, max_bytes=MAX_CONFIG_BYTES, what="config")
    except OSError as exc:
        raise ConfigError(f"cannot read a config.json from {config}: {exc}") from exc
    return load_object(data, where=str(path), max_bytes=MAX_CONFIG_BYTES, error=ConfigError)


def _tied_duplicates(weights: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> set[str]:
    if not config.get("tie_word_embeddings", True) or "lm_head.weight" not in weights:
        return set()
    head = weights["lm_head.weight"]
    for key, t in weights.items():
        embedding = key.endswith(("wte.weight", "embed_tokens.weight"))
        if embedding and t.shape == head.shape and torch.equal(t, head):
            return {"lm_head.weight"}
    return set()


def shard(
    weights: Mapping[str, torch.Tensor], max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    """Split ``weights`` in order into shards of at most ``max_shard_bytes`` (one tensor may
    exceed it alone, as in ``save_pretrained``)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in weights.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    return shards


def write_hf(
    weights: Mapping[str, torch.Tensor],
    out: str | os.PathLike[str],
    *,
    config: Mapping[str, Any] | None,
    generation_config: Mapping[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_SHARD,
) -> list[Path]:
    """Write ``weights`` (and ``config``) as a from_pretrained directory; the files written.

    Everything is written into a temporary directory beside ``out`` that is renamed to ``out``
    last, so a failure leaves no half directory."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError("export --format hf needs: pip install 'flashckpt[safetensors]'") from exc
    out_path = Path(out)
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; hf output needs a new directory")
    max_bytes = parse_bytes(max_shard_size, name="max_shard_size")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the model directory is an ordinary one
    try:
        names = _write_files(tmp, weights, config, generation_config, max_bytes, save_file)
        os.replace(tmp, out_path)  # onto a missing or empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out_path / n for n in names]


def _write_files(
    out_path: Path,
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | None,
    generation_config: Mapping[str, Any] | None,
    max_bytes: int,
    save_file: Any,
) -> list[str]:
    drop = _tied_duplicates(weights, config or {})
    kept = {k: v.contiguous() for k, v in weights.items() if k not in drop}
    shards = shard(kept, max_bytes)
    files: list[str] = []
    for name, doc in (("config.json", config), ("generation_config.json", generation_config)):
        if doc is not None:
            (out_path / name).write_text(json.dumps(dict(doc), indent=2, sort_keys=True) + "\n")
            files.append(name)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, part in zip(names, shards):
        save_file(part, str(out_path / name), metadata={"format": "pt"})
        files.append(name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in kept.values())},
            "weight_map": {k: name for name, part in zip(names, shards) for k in part},
        }
        (out_path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(INDEX_NAME)
    return files


def export_hf(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "model",
    config: Any = None,
    max_shard_size: int | str = DEFAULT_SHARD,
) -> int:
    """Export the model entry ``prefix`` of one step (newest by default); returns the step."""
    from flashckpt.integrations.saved import load_step

    saved = load_step(root, step=step)
    weights = saved.entries.get(prefix)
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(
            f"step {saved.step} of {root} has no model entry {prefix!r} "
            f"(entries: {sorted(saved.entries)}); pass --prefix NAME"
        )
    bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ConfigError(
            f"entry {prefix!r} of step {saved.step} is not a flat state_dict (key {bad[0]!r})"
        )
    meta = saved.manifest.meta.get(prefix, {})
    if config is not None:
        cfg = config_dict(config)
    elif isinstance(meta.get(CONFIG_ENTRY), Mapping):
        cfg = dict(meta[CONFIG_ENTRY])
    elif isinstance(saved.entries.get(CONFIG_ENTRY), Mapping):  # older FlashCkptCallback steps
        cfg = dict(saved.entries[CONFIG_ENTRY])
    else:
        raise ConfigError(
            f"step {saved.step} of {root} carries no model config for entry {prefix!r} (it was "
            "not a transformers model when saved); pass --config DIR_OR_CONFIG_JSON"
        )
    generation = meta.get(GENERATION_ENTRY)
    files = write_hf(
        weights,
        out,
        config=cfg,
        generation_config=generation if isinstance(generation, Mapping) else None,
        max_shard_size=max_shard_size,
    )
    log.info("exported step %d of %s as HF -> %s", saved.step, root, [f.name for f in files])
    return saved.step
