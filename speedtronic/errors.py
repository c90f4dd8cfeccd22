"""Exception types shared by every Speedtronic module.

The CLI turns any :class:`SpeedtronicError` into one ``speedtronic: error: ...`` line and exit
code 2, so raising one of these is how a module reports a problem the *user* can fix.
"""

from __future__ import annotations

import re
import reprlib
import signal


class SpeedtronicError(Exception):
    """Base class for user-facing errors (bad input, unusable files, unmet requirements)."""


class ConfigError(SpeedtronicError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    Subclasses ``ValueError`` so code that validates arguments generically still catches it.
    """


class NonFiniteError(SpeedtronicError):
    """The loss, a gradient norm or a weight became NaN or infinite (``train.on_nonfinite``).

    Raised before anything non-finite is written: every committed checkpoint stays finite.
    ``step`` is the first step found non-finite (None where unknown)."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class RunLockedError(SpeedtronicError):
    """Another live process holds the run directory's lock (one run per directory)."""


class RunPreempted(Exception):  # noqa: N818 - a stop that was asked for, not a failure
    """A preemption signal (SIGTERM, SIGINT, SIGUSR1, ...) stopped the run at a step boundary
    after its checkpoint was saved. Not a :class:`SpeedtronicError`: the CLI exits with
    :attr:`exit_code` (128 + the signal number, as a shell reports a killed command: 143 for
    SIGTERM, 130 for SIGINT), or 0 when the job was requeued."""

    def __init__(self, signum: int, message: str, *, requeued: bool = False) -> None:
        super().__init__(message)
        self.signum = signum
        self.requeued = requeued

    @property
    def exit_code(self) -> int:
        return 0 if self.requeued else 128 + self.signum


class Terminated(SystemExit):  # noqa: N818 - a stop that was asked for, not a failure
    """A signal whose default action ends the process (SIGTERM) arrived while a command had
    cleanup to do (``prepare``'s temporary shard folder). Raised on the main thread, as Ctrl-C
    raises KeyboardInterrupt, so ``except BaseException`` / ``finally`` clean up; not an
    ``Exception``, so no handler on the way turns it into an error message. The CLI prints one
    line and exits :attr:`exit_code` (128 + the signal number: 143 for SIGTERM); uncaught in a
    script it exits with that status too, quietly, as the signal itself would have (a
    ``BaseException`` there was a traceback and exit 1: a failure to a scheduler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated ({signal.Signals(self.signum).name})"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# ----------------------------------------------------------------------------- messages
# A message echoes what the user gave; both bounds below keep a hostile value from turning one
# error line into megabytes or a leak. Measured: a 573-byte YAML of nested aliases once made a
# type error's repr walk 10^9 values (a minute, 2.3 GB, then MemoryError).
_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 6
_BRIEF.maxlevel = 2
_BRIEF_MAX = 160  # characters of one echoed value

#: Credentials in a URL's userinfo (``s3://key:secret@host``). The userinfo ends at the *last*
#: ``@`` before the host, and secrets may hold ``/`` (AWS secret keys often do), so the match runs
#: from ``://`` up to the last ``@`` that is not followed by whitespace. Also used by
#: :mod:`speedtronic.config.redaction` for what is written to disk.
URL_USERINFO = re.compile(r"(://)[^\s]*@(?=[^\s@]*$|[^\s@]*\s)")

_SECRET_PATTERNS = [
    (URL_USERINFO, r"\1<redacted>@"),  # s3://KEY:SECRET@host -> s3://<redacted>@host
    # well-known token shapes (Hugging Face, AWS access keys, GitHub, OpenAI-style keys)
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "<redacted>"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "<redacted>"),
    (re.compile(r"\b(?:ghp|gho|ghs|github_pat)_[A-Za-z0-9_]{20,}"), "<redacted>"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), "<redacted>"),
    # key: value / key=value pairs whose key names a credential
    (re.compile(r"(?i)(['\"]?\b(?:[a-z_]*_)?(?:token|secret|password|api_key|access_key|"
                r"secret_key)['\"]?\s*[:=]\s*)(['\"]?)[^\s,'\"}]+\2"), r"\1\2<redacted>\2"),
]


def mask_secrets(text: str) -> str:
    """``text`` with credentials masked: URL userinfo, token-shaped strings and values of
    credential-named keys (the CLI applies it to every error line it prints)."""
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def first_line(exc: BaseException, empty: str | None = None) -> str:
    """The first line of ``exc``'s message (library errors run to pages), or ``empty`` (the
    exception's type name when None) when it has none."""
    text = str(exc).strip()
    if text:
        return text.splitlines()[0]
    return type(exc).__name__ if empty is None else empty


def brief(value: object) -> str:
    """A bounded, credential-masked ``repr`` for error messages (strings to 80 characters,
    6 items per container, 2 levels, 160 characters in all), so a huge or self-aliased value
    cannot blow up a message."""
    text = mask_secrets(_BRIEF.repr(value))
    return text if len(text) <= _BRIEF_MAX else text[:_BRIEF_MAX - 3] + "..."


def import_factory(spec: str, key: str) -> object:
    """The callable ``spec`` (``"package.module:name"``) names, for config key ``key``
    (``model.name``, ``data.dataset``); one ConfigError naming the key when the module does not
    import or holds no such callable."""
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module_name!r} from {spec!r}: {exc} "
                          "(the module must be importable: installed, in the working "
                          "directory, or on PYTHONPATH)") from exc
    try:  # a lazy module's __getattr__ may raise ImportError (speedtronic's for 2.0 names)
        factory = getattr(module, attr, None)
    except ImportError as exc:
        raise ConfigError(f"{key}: {spec!r}: {exc}") from None
    if not callable(factory):
        raise ConfigError(f"{key}: {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def check_factory_call(factory: object, key: str, spec: str, expected: str) -> None:
    """ConfigError unless ``factory(cfg)`` binds: one positional argument. Checked before the
    call, so a TypeError raised inside a correct factory's body still surfaces as that bug.
    ``key`` is the config key that named it, ``expected`` what it should return."""
    import inspect

    try:
        sig = inspect.signature(factory)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no introspectable signature (some builtins): just call it
        return
    try:
        sig.bind(object())
    except TypeError as exc:
        raise ConfigError(f"{key}: {spec!r} cannot be called as factory(cfg) ({exc}; its "
                          f"signature is {spec.rpartition(':')[2]}{sig}); expected a callable "
                          f"taking the config as its one positional argument and returning "
                          f"{expected}") from None
