"""One exception tree for the installer; each kind has its own exit code.

Every error renders as one line: what failed, expected vs actual where there is one, and what to
do next. The CLI is the only place that prints them.
"""
from __future__ import annotations


class InstallerError(Exception):
    exit_code = 1
    kind = "error"

    def __init__(self, what: str, *, expected: str | None = None, actual: str | None = None,
                 fix: str | None = None, log: str | None = None, detail: str | None = None):
        super().__init__(what)
        self.detail = detail  # several lines (a log tail) the CLI prints before the line
        self.what = what
        self.expected = expected
        self.actual = actual
        self.fix = fix
        self.log = log

    def __str__(self) -> str:
        return self.line()

    def line(self) -> str:
        parts = [self.what]
        if self.expected is not None or self.actual is not None:
            parts.append(f"expected {self.expected}, got {self.actual}")
        if self.log:
            parts.append(f"log: {self.log}")
        if self.fix:
            parts.append(self.fix)
        return f"{self.kind}: " + "; ".join(parts)


class UsageError(InstallerError):
    exit_code = 2
    kind = "usage error"


class RecipeError(InstallerError):
    exit_code = 3
    kind = "recipe error"


class DownloadError(InstallerError):
    """A source could not be downloaded (HTTP error, connection refused, interrupted)."""
    exit_code = 4
    kind = "download error"


class OfflineError(DownloadError):
    """No source location answered and no mirror was given."""
    exit_code = 5
    kind = "offline"


class ChecksumError(InstallerError):
    """A file or commit differs from its pin."""
    exit_code = 6
    kind = "checksum mismatch"


class SystemPackagesError(InstallerError):
    exit_code = 7
    kind = "system packages"


class BuildError(InstallerError):
    exit_code = 8
    kind = "build failed"


class BuildToolsError(InstallerError):
    """A tool the build-tools phase installed is missing or does not run: found where it is made,
    before anything is built, not later as a host error."""
    exit_code = 13
    kind = "build tools"


class VerifyError(InstallerError):
    exit_code = 9
    kind = "verification failed"


class PrefixError(InstallerError):
    exit_code = 10
    kind = "prefix"


class HostError(InstallerError):
    """The host refused: a full disk, a permission, a read-only file system."""
    exit_code = 11
    kind = "host error"

    @classmethod
    def from_oserror(cls, e: OSError, where: str) -> "HostError":
        import errno
        fix = {
            errno.ENOSPC: "free space there (the download and build cache can go: --cache-dir) and "
                          "run again",
            errno.EACCES: "run as a user who may write there, or choose another "
                          "--prefix/--cache-dir",
            errno.EROFS: "choose a writable --prefix/--cache-dir",
        }.get(e.errno, "fix that and run again")
        return cls(f"{where}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""),
                   fix=fix + "; the previous install is untouched")


class BinaryCacheError(InstallerError):
    """A binary cache entry or directory that cannot be used: wrong hash, broken archive, a build
    id published before with a different manifest, a cache that cannot be written."""
    exit_code = 12
    kind = "binary cache"


class Interrupted(InstallerError):
    exit_code = 130
    kind = "interrupted"


# exit code -> the error that exits with it: the installer's table (docs/exit-codes.md; the
# command-line convention kvruntime shares: kvruntime/tools/cli.py)
EXIT_CODES = {e.exit_code: e for e in (
    UsageError, RecipeError, DownloadError, OfflineError, ChecksumError, SystemPackagesError,
    BuildError, VerifyError, PrefixError, HostError, BinaryCacheError, BuildToolsError,
    Interrupted)}
