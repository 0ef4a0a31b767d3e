"""Mutation testing of the policy and validation code with mutmut, outside tools/check.

::

    .venv/bin/pip install mutmut==3.8.1      # the "mutation" dependency group
    .venv/bin/python -m tools.mutation [--jobs N] [--keep DIR] [--min-score 85]

What is mutated and which tests run is ``[tool.mutmut]`` in pyproject.toml: ``netshaper/``,
``gpud/mig/plan.py``, ``gpud/mig/validate.py`` and ``gpud/api/validate.py``, against the unit
tests that cover them. mutmut changes one operator, constant or call at a time and runs the
tests that reach the changed function; a mutant is *killed* when a test fails.

The run happens in a copy of the working tree (tracked files and untracked, not ignored
ones) in a temporary directory, so that the tree is not touched and edits made meanwhile do
not mix into the run. Prints every surviving mutant's diff and the score

    killed / (killed + survived + no tests + suspicious)     (timeouts count as killed)

and exits 1 when the score is under ``--min-score``. CPU-heavy: minutes per hundred
mutants on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tree_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def copy_tree(dest: Path) -> None:
    for name in _tree_files():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def mutmut(work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["GPUD_HYPOTHESIS_PROFILE"] = "mutation"  # no shrinking, fixed seed: tests/unit/conftest.py
    return subprocess.run(
        [sys.executable, "-m", "mutmut", *args],
        cwd=work,
        env=env,
        text=True,
        capture_output=True,
        check=False,
    )


def score(stats: dict[str, int]) -> float:
    killed = stats["killed"] + stats["timeout"]
    judged = killed + stats["survived"] + stats["no_tests"] + stats["suspicious"]
    return 100.0 * killed / judged if judged else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="parallel mutants (default 2)")
    parser.add_argument("--keep", type=Path, help="run in DIR and keep it (mutmut browse)")
    parser.add_argument("--min-score", type=float, default=85.0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gpud-mutation-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        copy_tree(work)
        run = mutmut(work, "run", "--max-children", str(args.jobs))
        if run.returncode != 0:
            print(run.stdout[-4000:], run.stderr[-4000:], sep="\n", file=sys.stderr)
            print("mutmut run failed", file=sys.stderr)
            return 2
        mutmut(work, "export-cicd-stats")
        stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
        survivors = [
            line.strip().split(":")[0]
            for line in mutmut(work, "results").stdout.splitlines()
            if line.strip()
        ]
        for name in survivors:
            print(mutmut(work, "show", name).stdout)
    figure = score(stats)
    print(json.dumps(stats, indent=2))
    print(f"mutation score: {figure:.1f} % killed ({stats['total']} mutants)")
    return 0 if figure >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
