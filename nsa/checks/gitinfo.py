"""Git snapshot of the code being run (GitPython): branch, commit, dirty files."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def git_snapshot(path: str | Path | None = None, max_files: int = 50) -> dict[str, Any]:
    """``{available, branch, commit, dirty, dirty_files, error}``; never raises."""
    start = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        import git
    except ImportError:
        return {"available": False, "error": "GitPython is not installed"}
    try:
        repo = git.Repo(start, search_parent_directories=True)
    except Exception as exc:
        return {"available": False, "error": f"not a git repository ({type(exc).__name__})"}
    try:
        try:
            commit = repo.head.commit.hexsha
        except ValueError:
            commit = None
        try:
            branch: str | None = repo.active_branch.name
        except TypeError:
            branch = None  # detached HEAD
        changed: list[str] = [d.a_path for d in repo.index.diff(None) if d.a_path]
        if commit is not None:
            changed += [d.a_path for d in repo.index.diff("HEAD") if d.a_path]
        untracked = repo.untracked_files
        files = sorted(set(changed)) + [f"?? {f}" for f in sorted(untracked)]
        return {
            "available": True,
            "root": str(repo.working_tree_dir),
            "branch": branch,
            "commit": commit,
            "short": commit[:12] if commit else None,
            "dirty": bool(files),
            "dirty_count": len(files),
            "dirty_files": files[:max_files],
        }
    except Exception as exc:
        return {"available": False, "error": f"git query failed ({type(exc).__name__}: {exc})"}
    finally:
        repo.close()
