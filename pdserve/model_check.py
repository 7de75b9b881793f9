"""Is a model folder servable? One line that says what is wrong, before any service starts.

    python -m pdserve.model_check /models/Qwen3.6-35B-A3B [--hint "set PDSERVE_MODELS_DIR ..."]

exits 0 with a one-line summary, or 1 with one line naming the problem (and the hint): no such
folder, an empty folder (a volume mounted from the wrong place, or not filled yet), a file this
user cannot read (a non-root container reading a mounted checkpoint), no config.json or an
unsupported one, no tokenizer.json, no weights (or an index naming missing shards).

The containers run it first (compose's `model-check` service, the Kubernetes init containers),
so a wrong model path stops the deployment with this line instead of crash-looping engines.
Plain Python and the torch-free `pdserve.model_config`: it runs in the router image too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pdserve.model_config import ModelConfig

INDEX = "model.safetensors.index.json"


class ModelFolderError(ValueError):
    pass


def _readable(path: Path) -> Path:
    if not os.access(path, os.R_OK):
        raise ModelFolderError(
            f"{path} is not readable by uid {os.getuid()}: make the checkpoint world-readable "
            "(chmod -R a+rX) or run the container as a user that may read it"
        )
    return path


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards: those the index names (each must exist), else every *.safetensors."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(_readable(index).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFolderError(f"{index} is not a safetensors index ({e})") from e
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ModelFolderError(f"{index} names shard(s) that are not there: {shown}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"no weights in {model_dir} (no *.safetensors, no {INDEX})")
    return files


def check_model_folder(model_dir: str | Path) -> str:
    """A one-line summary of a servable model folder; `ModelFolderError` (a ValueError) if it is not."""
    root = Path(model_dir)
    if not root.exists():
        raise ModelFolderError(f"no model folder at {root}")
    if not root.is_dir():
        raise ModelFolderError(f"{root} is not a folder")
    if not os.access(root, os.R_OK | os.X_OK):
        raise ModelFolderError(f"the model folder {root} is not readable by uid {os.getuid()}")
    if not any(root.iterdir()):
        raise ModelFolderError(f"the model folder {root} is empty")
    for name in ("config.json", "tokenizer.json"):
        if not (root / name).is_file():
            raise ModelFolderError(f"no {name} in {root}: is this a Hugging Face checkpoint folder?")
        _readable(root / name)
    config = ModelConfig.from_pretrained(root)
    files = [_readable(f) for f in weight_files(root)]
    gib = sum(f.stat().st_size for f in files) / 2**30
    return (
        f"{root}: {config.model_type}, {config.num_hidden_layers} layers, {config.num_experts} experts, "
        f"{len(files)} weight file(s), {gib:.1f} GiB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.model_check", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--hint", default="", help="appended to the error line (what to set, and where)")
    args = parser.parse_args(argv)
    try:
        print(f"model ok: {check_model_folder(args.model_dir)}", flush=True)
    except ValueError as e:  # ModelConfig's own errors (unsupported model_type, bad JSON) included
        hint = f"; {args.hint}" if args.hint else ""
        print(f"pdserve: cannot serve this model: {e}{hint}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
