"""Code every service and the CLI share (message schemas, bus, profiles, ...); see each module."""

PACKAGE = "evolving-infra"
"""This project's distribution name (``pyproject.toml`` ``[project] name``)."""


def package_version() -> str:
    """The installed ``evolving-infra`` distribution's version (``importlib.metadata``): what a router's
    ``GET /version`` serves and ``evolving-infra --version`` prints; ``"unknown"`` when the package is not
    installed (a bare source tree)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
