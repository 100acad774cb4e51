"""The rendezvous state's codec: signed with the job's secret (see "Trust" in the package
docstring: `load_secret`, `sign_state`, `verify_state`), and unpickled with torch's rendezvous
classes only (`decode_state`)."""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
from base64 import b64decode, b64encode
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from pipetransformer.core import keys


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return b64decode(text.encode(), validate=True)


# -- signed state -----------------------------------------------------------------------------

SIGNED_PREFIX = "v1:"
_MIN_SECRET_BYTES = 16


def load_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The job's rendezvous secret from the environment (its value, else the file it names);
    None when neither is set. A file that cannot be read, or a secret shorter than 16 bytes,
    is an error: signing with a guessable key would only look safe."""
    value = environ.get(keys.RDZV_SECRET_ENV)
    where = f"${keys.RDZV_SECRET_ENV}"
    if not value and (path := environ.get(keys.RDZV_SECRET_FILE_ENV)):
        where = f"${keys.RDZV_SECRET_FILE_ENV} ({path})"
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read(4096)
        except OSError as exc:
            raise ValueError(f"{where}: the rendezvous secret cannot be read: {exc}") from None
    if not value:
        return None
    secret = value.strip().encode()
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(
            f"{where}: the rendezvous secret must be at least {_MIN_SECRET_BYTES} characters "
            "(make one with `openssl rand -hex 32`)"
        )
    return secret


def _mac(secret: bytes, key: str, state: bytes) -> str:
    # the key is in the MAC: a state signed for one run cannot be moved to another's key
    return hmac.new(secret, key.encode() + b"\0" + state, hashlib.sha256).hexdigest()


def sign_state(secret: bytes, key: str, state: bytes) -> str:
    """The etcd value for `state` at `key`: ``v1:<hex HMAC-SHA256>:<base64 state>``."""
    return f"{SIGNED_PREFIX}{_mac(secret, key, state)}:{_b64(state)}"


class StateRefused(RendezvousStateError):
    """A rendezvous state that does not verify; nothing unpickled it."""


def verify_state(secret: bytes | None, key: str, value: str) -> bytes:
    """The state bytes of an etcd value written by `sign_state` (with a secret) or plain base64
    (without one), or StateRefused saying why."""
    signed = value.startswith(SIGNED_PREFIX)
    if secret is None:
        if signed:
            raise StateRefused(
                f"The rendezvous state at {key} is signed, and this agent has no secret to check "
                f"it with: set ${keys.RDZV_SECRET_ENV} (or ${keys.RDZV_SECRET_FILE_ENV}) as the "
                "job's other agents have it."
            )
        return _unb64(value)
    if not signed:
        raise StateRefused(
            f"The rendezvous state at {key} is not signed with the job's secret (someone without "
            "it wrote the key); refused before unpickling it."
        )
    mac, sep, body = value[len(SIGNED_PREFIX) :].partition(":")
    state = _unb64(body) if sep else b""
    # bytes, not str: compare_digest refuses (TypeError) a str with non-ASCII characters
    if not sep or not hmac.compare_digest(mac.encode(), _mac(secret, key, state).encode()):
        raise StateRefused(
            f"The rendezvous state at {key} does not verify against the job's secret (forged, "
            "or written by an agent given another secret); refused before unpickling it."
        )
    return state


# -- torch's pickled state, with its own classes only --------------------------------------

_TORCH_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# everything a pickled `_RendezvousState` refers to; anything else is not one
_STATE_CLASSES: dict[tuple[str, str], type] = {
    (_TORCH_RDZV, "_RendezvousState"): _RendezvousState,
    (_TORCH_RDZV, "_NodeDesc"): _NodeDesc,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _STATE_CLASSES[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of a rendezvous state"
            ) from None


def decode_state(data: bytes) -> _RendezvousState:
    """torch's pickled rendezvous state, unpickled with nothing but its own classes allowed (the
    backend reads states to merge them; a pickle naming anything else is refused unread)."""
    try:
        state = _StateUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise RendezvousStateError(f"The rendezvous state is not torch's: {exc}") from None
    if not isinstance(state, _RendezvousState):
        raise RendezvousStateError("The rendezvous state is not torch's.")
    return state


def encode_state(state: _RendezvousState) -> bytes:
    return pickle.dumps(state)  # as torch's state holder does


def copy_state(state: _RendezvousState) -> _RendezvousState:
    """A copy that shares only immutable parts (node descriptors, datetimes)."""
    new = _RendezvousState()
    new.round, new.complete, new.deadline, new.closed = (
        state.round,
        state.complete,
        state.deadline,
        state.closed,
    )
    new.participants = dict(state.participants)
    new.wait_list = set(state.wait_list)
    new.redundancy_list = set(state.redundancy_list)
    new.last_heartbeats = dict(state.last_heartbeats)
    return new
