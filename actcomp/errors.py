"""The one error type actcomp raises for bad user input."""


class ActcompError(ValueError):
    """Bad spec, option or argument given to actcomp.

    >>> import actcomp
    >>> try:
    ...     actcomp.parse("mnk0.9")
    ... except actcomp.ActcompError as error:
    ...     print(str(error).splitlines()[0])
    unknown stage 'mnk0.9' in spec 'mnk0.9'
    """
