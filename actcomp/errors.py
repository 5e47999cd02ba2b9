"""The one error type actcomp raises for bad user input, and its warnings said once."""

from __future__ import annotations

import warnings
from collections.abc import Hashable


class ActcompError(ValueError):
    """Bad spec, option or argument given to actcomp.

    >>> import actcomp
    >>> try:
    ...     actcomp.parse("mnk0.9")
    ... except actcomp.ActcompError as error:
    ...     print(str(error).splitlines()[0])
    unknown stage 'mnk0.9' in spec 'mnk0.9'
    """


# Keys of the warnings given so far in this process. A key names its warning's site and what it
# is about (a layer, a model class); tests may discard a key to hear a warning again.
WARNED: set[Hashable] = set()


def warn_once(key: Hashable, message: str, stacklevel: int = 1) -> None:
    """``warnings.warn(message)`` the first time ``key`` comes; ``stacklevel`` counts from the
    caller, as for ``warnings.warn``. Per-step code warns about a model once, not once a step.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for step in range(3):
    ...         warn_once(("example", "model"), "said once")
    >>> [str(warning.message) for warning in caught]
    ['said once']
    """
    if key not in WARNED:
        WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
