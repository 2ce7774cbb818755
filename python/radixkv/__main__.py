"""The radixkv command: `radixkv replay ...` (also `python -m radixkv replay ...`)."""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"replay": "replay a trace or the built-in workload through the cache"}
    if argv and argv[0] in ("-V", "--version"):
        from radixkv import __version__

        print(f"radixkv {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: radixkv [--version] COMMAND [options]\n\ncommands:")
        for name, what in commands.items():
            print(f"  {name:<8} {what}")
        return 0
    if argv[0] not in commands:
        print(
            f"error: radixkv: unknown command {argv[0]!r} (commands: {', '.join(commands)}; "
            "radixkv --help lists them)",
            file=sys.stderr,
        )
        return 2
    from radixkv.replay.cli import main as replay_main

    return replay_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
