"""The README's first two commands are what CI runs, verbatim, from the clone's root."""

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _readme_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
    return [line.split("  #", 1)[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_both_readme_commands_main_job_first():
    commands = _readme_commands()
    assert len(commands) == 2
    main_job, tests = commands
    assert "ferro run" in main_job and tests.endswith("pytest")
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [line.strip() for line in f]
    assert main_job in lines and tests in lines
    assert lines.index(main_job) < lines.index(tests)
