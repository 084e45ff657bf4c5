"""pip's package sources as uv's command-line options: uv reads no pip configuration, so that `make install` resolves
against the same indexes, wheel folders and constraints as `pip install` would (``pip config list``: files and PIP_*
variables, the environment's value winning over the files', as in pip).

    python .ci/uv_args.py   # -> e.g. --find-links /opt/wheels --extra-index-url file:///opt/pypi/simple ...
"""

import shlex
import subprocess
import sys

# pip's key -> uv's option; the keys that take several space-separated values
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
SCOPE_ORDER = ("global", "site", "user", ":env:")  # later wins, as pip reads them


def pip_settings() -> dict[str, str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[tuple[int, str], str] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if key in OPTIONS and scope in SCOPE_ORDER:
            found[(SCOPE_ORDER.index(scope), key)] = value.strip("'\"")
    return {key: value for (_, key), value in sorted(found.items())}


def main() -> None:
    args = []
    for key, value in pip_settings().items():
        for item in value.split():
            args += [OPTIONS[key], item]
    # pip takes the best version over all its indexes; uv only the first index's unless told
    print(shlex.join([*args, "--index-strategy", "unsafe-best-match"]))


if __name__ == "__main__":
    main()
