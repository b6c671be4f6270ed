"""The `kvt` command (installed by `pip install .`): one entry for every stage that has a command line.

    kvt run [options]          calibrate, evaluate, benchmark and report on a pair (kvt/harness/pipeline.py; = python run.py)
    kvt bench [options]        prefill vs transfer on random weights of named shapes (kvt/harness/bench.py)
    kvt plan [options]         the memory plan of a pair on named GPUs, and its disk and time (kvt/harness/costs.py)
    kvt toy train [options]    retrain the toy family (kvt/harness/toy.py)
    kvt family build [options] build a pruned and healed sibling of a checkpoint (kvt/teach/family.py)
    kvt figures r2|gate ...    the layer R^2 map of a pair; diagnostics against retention (kvt/harness/figures.py)
    kvt cascade RECORDS        a small -> large cascade from a run's records: accuracy against cost (kvt/teach/cascade.py)
    kvt course list|make|grade   assignments cut out of kvt for students and their autograder (kvt/teach/course.py)

A problem the user can fix ends as one line on stderr, `kvt: ...`, with exit status 2 (argparse's own
errors exit 2 too); Ctrl-C ends with exit status 130 and a line saying whether a rerun resumes (run and
family build keep checkpoints; the others start over).
"""
import importlib
import sys

from kvt.config import command

COMMANDS = {"run": "harness.pipeline", "bench": "harness.bench", "plan": "harness.costs", "toy": "harness.toy",
            "family": "teach.family", "figures": "harness.figures", "cascade": "teach.cascade", "course": "teach.course"}
RESUMES = {"run", "family"}  # commands whose rerun picks up the checkpoints an interrupted one left
EXIT_USER_ERROR = 2
USAGE = "usage: kvt <command> [options]; `kvt <command> --help` lists a command's options"


def entry(argv):
    """Run `kvt <command> ...` with argv = [command, *its arguments]; exits with the statuses above."""
    if not argv or argv[0] in ("-h", "--help"):  # asked for: stdout, exit 0; a bare `kvt`: stderr, exit 2
        print(USAGE + "\n\n" + __doc__.split("\n\n")[1], file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else EXIT_USER_ERROR)
    if argv[0] not in COMMANDS:
        print(f"kvt: unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} (kvt --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    module = importlib.import_module(f"kvt.{COMMANDS[argv[0]]}")
    command(module.main, argv[1:], resumes=argv[0] in RESUMES)  # KvtError: one line, exit 2; Ctrl-C: 130


def main():
    entry(sys.argv[1:])


if __name__ == "__main__":
    main()
