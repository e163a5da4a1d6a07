"""``python -m train.export <checkpoint> --to <dir>``: a checkpoint as a Hugging Face model directory.

``<checkpoint>`` is a ``step_XXXXXXXX`` directory, or a checkpoints directory (its newest complete
checkpoint), written at any world or EP size. See :mod:`train.hf.export`.
"""

import argparse
import os
import sys

from train.checkpoint import list_checkpoints
from train.hf.architectures import ARCHITECTURES
from train.hf.export import DTYPES, export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step_XXXXXXXX directory, or a checkpoints directory (its newest)")
    parser.add_argument("--to", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--arch", choices=sorted(a for a, v in ARCHITECTURES.items() if v.attention),
                        help="default: the architecture the run was initialised from, else the one its options imply")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: the source model's, else float32")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --to directory")
    args = parser.parse_args(argv)
    path = args.checkpoint
    if not os.path.isfile(os.path.join(path, "meta.json")):
        found = list_checkpoints(path)
        if not found:
            print(f"error: {path} is neither a checkpoint (no meta.json) nor a directory of checkpoints", file=sys.stderr)
            return 2
        path = found[-1]
    try:
        config = export(path, args.to, args.arch, args.dtype, int(args.max_shard_gb * 2**30), args.overwrite)
    except ValueError as e:  # HFError, CheckpointError: one line naming the file, key or tensor
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.to} ({config['model_type']}, {config['dtype']}) from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
