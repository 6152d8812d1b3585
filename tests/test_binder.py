"""Binder set-up (``binder/``): the requirements install nbdebug itself with the CPU build of
torch, every pinned or ranged version agrees with ``pyproject.toml``, and the launch URL in
the README opens a notebook that exists. No network: the files are parsed with ``packaging``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def project_ranges() -> dict[str, SpecifierSet]:
    """Every dependency of pyproject.toml (main and extras) -> its version range."""
    proj = pyproject()["project"]
    ranges: dict[str, SpecifierSet] = {}
    reqs = list(proj["dependencies"])
    for extra in proj.get("optional-dependencies", {}).values():
        reqs += extra
    for text in reqs:
        r = Requirement(text)
        name = canonicalize_name(r.name)
        ranges[name] = ranges.get(name, SpecifierSet()) & r.specifier
    return ranges


def read_requirements(path: Path) -> tuple[list[str], list[str], list[Requirement]]:
    """(option lines, local install targets, parsed requirements) of a pip requirements file."""
    options, local, reqs = [], [], []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-e ") or line.startswith("--editable "):
            local.append(line.split(None, 1)[1].strip())
        elif line in (".", "./") or line.startswith((".[", "./[")):
            local.append(line)
        elif line.startswith("-"):
            options.append(line)
        else:
            try:
                reqs.append(Requirement(line))
            except InvalidRequirement as e:  # pragma: no cover - the assertion message is the point
                pytest.fail(f"{path.name}: cannot parse {line!r}: {e}")
    return options, local, reqs


REQUIREMENTS = BINDER / "requirements.txt"


def test_binder_files_are_there():
    assert REQUIREMENTS.is_file(), "binder/requirements.txt is what repo2docker installs"
    assert not (BINDER / "README.md").exists()
    post = BINDER / "postBuild"
    if post.exists():  # optional; when there, repo2docker runs it as an executable script
        assert os.access(post, os.X_OK) and post.read_text().startswith("#!")


def test_requirements_install_the_package_itself():
    _, local, _ = read_requirements(REQUIREMENTS)
    assert local, "binder/requirements.txt must install nbdebug itself: add '-e .' (or '.')"
    # repo2docker runs pip from the repository root: '.' is the project with pyproject.toml
    assert all(re.fullmatch(r"\.(/)?(\[[\w,-]+\])?", t) for t in local), local
    assert pyproject()["project"]["name"] == "nbdebug"


def test_torch_is_the_cpu_build():
    options, _, reqs = read_requirements(REQUIREMENTS)
    index = [o for o in options if o.startswith(("--extra-index-url", "--index-url", "-i "))]
    assert any(CPU_INDEX in o for o in index), (
        f"Binder has no GPU: add --extra-index-url {CPU_INDEX}"
    )
    torch = [r for r in reqs if canonicalize_name(r.name) == "torch"]
    assert len(torch) == 1, "pin torch in binder/requirements.txt (never an unpinned torch)"
    pins = [s for s in torch[0].specifier if s.operator in ("==", "===")]
    assert pins and Version(pins[0].version).local == "cpu", f"pin the +cpu wheel; got {torch[0]}"


def test_pinned_versions_agree_with_pyproject():
    ranges = project_ranges()
    _, _, reqs = read_requirements(REQUIREMENTS)
    assert reqs, "no requirement parsed"
    seen = set()
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name not in seen, f"{r.name} is listed twice"
        seen.add(name)
        assert name in ranges, (
            f"binder installs {r.name}, which pyproject.toml does not name: add it there or drop it"
        )
        allowed = ranges[name]
        pins = [s.version for s in r.specifier if s.operator in ("==", "===")]
        if pins:
            for v in pins:
                assert allowed.contains(Version(v), prereleases=True), (
                    f"binder pins {r.name}=={v} outside pyproject.toml's {allowed}"
                )
        else:
            # a range: its lower bound must be allowed by pyproject.toml
            lows = [s.version for s in r.specifier if s.operator in (">=", "~=", ">")]
            for v in lows:
                assert allowed.contains(Version(v), prereleases=True), (
                    f"binder allows {r.name}{r.specifier}, starting outside "
                    f"pyproject.toml's {allowed}"
                )
    # what the notebooks need at run time comes with nbdebug's own dependencies
    for dep in pyproject()["project"]["dependencies"]:
        name = canonicalize_name(Requirement(dep).name)
        assert name in seen, (
            f"pin {name} in binder/requirements.txt (Binder builds are reproducible "
            f"when all are pinned)"
        )
    for kernel in ("jupyterlab", "ipykernel"):
        assert kernel in seen


def test_runtime_python_satisfies_requires_python():
    runtime = BINDER / "runtime.txt"
    assert runtime.is_file()
    m = re.fullmatch(r"python-(\d+\.\d+)", runtime.read_text().strip())
    assert m, "binder/runtime.txt holds python-X.Y"
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    assert requires.contains(Version(m.group(1)))


def binder_links() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"https://mybinder\.org/v2/gh/[^\s)\]]+", text)


def test_readme_binder_link_opens_an_existing_notebook_in_jupyterlab():
    links = binder_links()
    assert links, "README.md needs the Binder badge link"
    for link in links:
        url = urlparse(link)
        parts = url.path.split("/")
        # /v2/gh/OWNER/REPO/REF
        assert parts[:3] == ["", "v2", "gh"] and len(parts) >= 6 and parts[4] == "nbdebug", link
        urlpath = parse_qs(url.query).get("urlpath")
        assert urlpath, f"{link}: add ?urlpath=lab/tree/<notebook>"
        target = unquote(urlpath[0])
        assert target.startswith("lab/tree/"), (
            f"{link}: open JupyterLab (lab/tree/...), got {target}"
        )
        rel = target[len("lab/tree/") :]
        assert (ROOT / rel).is_file(), f"{link} opens {rel}, which does not exist"
    assert any(link.endswith("urlpath=lab/tree/notebooks/01_quickstart.ipynb") for link in links)


def test_the_pins_are_the_versions_the_tests_run_with():
    """binder/requirements.txt says its pins are the versions the test suite runs with:
    every pinned distribution is installed here at that version (torch's +cpu label aside,
    which only says which wheel index it comes from). `make setup` installs under the pins
    as constraints, so this fails only when a pin moved and the venv was not set up again."""
    from importlib.metadata import PackageNotFoundError, version

    _, _, reqs = read_requirements(REQUIREMENTS)
    for r in reqs:
        pins = [s.version for s in r.specifier if s.operator in ("==", "===")]
        if not pins:
            continue
        try:
            installed = Version(version(r.name))
        except PackageNotFoundError:
            pytest.fail(f"binder pins {r.name}=={pins[0]}, which is not installed here")
        assert installed.public == Version(pins[0]).public, (
            f"binder pins {r.name}=={pins[0]} but the tests run with {installed}: "
            f"update binder/requirements.txt"
        )


def test_the_badge_owner_is_an_account_or_the_explained_placeholder():
    """The account is not recorded in this repository: the link holds either a GitHub
    account name or the placeholder OWNER, and then the README says how to fill it in."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for link in binder_links():
        owner = urlparse(link).path.split("/")[3]
        if owner == "OWNER":
            assert "replace `OWNER`" in readme and "<account>" in readme, (
                "the Binder link holds the placeholder OWNER: say in the README how to replace it"
            )
        else:
            assert re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,37}[A-Za-z0-9])?", owner), (
                f"{link}: {owner!r} is not a GitHub account name"
            )
