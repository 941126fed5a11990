"""dtrain.common.checkout: the commit a folder is checked out at, as run.json records it, and nothing where there
is none (no checkout, an untracked folder inside one, no git)."""

import subprocess

import pytest

from dtrain.common.checkout import git_commit


def git(repo, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A checkout with one commit of pkg/mod.py; git looks no higher than tmp_path for a repository."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    git(root, "init", "-q")
    git(root, "add", "pkg/mod.py")
    git(root, "commit", "-q", "-m", "one")
    return root


def test_a_clean_checkout_gives_its_head(repo):
    head = git(repo, "rev-parse", "HEAD")
    assert len(head) == 40
    assert git_commit(repo / "pkg") == {"commit": head} == git_commit(repo)


def test_changes_make_it_dirty(repo):
    head = git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "mod.py").write_text("x = 2\n")
    assert git_commit(repo / "pkg") == {"commit": head, "dirty": True}
    git(repo, "checkout", "-q", "--", "pkg/mod.py")
    (repo / "pkg" / "new.py").write_text("")  # an untracked file is a change too
    assert git_commit(repo / "pkg") == {"commit": head, "dirty": True}


def test_no_commit_outside_a_checkout_or_in_an_untracked_folder(repo, tmp_path):
    (tmp_path / "plain").mkdir()
    assert git_commit(tmp_path / "plain") == {}
    # e.g. a copy installed into a virtual environment inside another project's checkout
    (repo / "venv" / "site-packages" / "pkg").mkdir(parents=True)
    (repo / "venv" / "site-packages" / "pkg" / "mod.py").write_text("")
    assert git_commit(repo / "venv" / "site-packages" / "pkg") == {}
    assert git_commit(tmp_path / "missing") == {}


def test_a_repository_without_commits_or_without_git_gives_nothing(tmp_path, monkeypatch, repo):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no git to run
    assert git_commit(repo / "pkg") == {}
    monkeypatch.undo()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "a.py").write_text("")
    git(fresh, "init", "-q")
    git(fresh, "add", "a.py")  # tracked, but no commit yet
    assert git_commit(fresh) == {}
