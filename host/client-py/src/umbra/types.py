"""The IPC's types (``TypedDict``s and ``Literal`` aliases), generated from the same JSON
Schema as the TypeScript client's: ``umbra.types.SessionInfo``, ``umbra.types.SessionEvent``…"""

from ._generated import *  # noqa: F403
