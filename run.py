"""kvt end to end, the design card's entry point: `python run.py [options]` is `kvt run [options]`.

    python run.py                          # the toy family toy-s -> toy-m, offline
    python run.py --pair qwen3-14b:32b     # weights/qwen3-14b -> weights/qwen3-32b
    python run.py --help                   # every option

The code is kvt/harness/pipeline.py (the last stage of the data flow); kvt/cli.py turns errors into one line.
"""
import sys

from kvt.cli import entry

if __name__ == "__main__":
    entry(["run", *sys.argv[1:]])
