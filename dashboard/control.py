"""The dashboard's actions: signing in, filing a manual freeze request for a running job, and
asking its ranks to trace one step.

Reading is open; acting needs a signed-in user (`dashboard.auth`). A freeze request goes through
`edge.overrides.file_freeze_request`, the same validation as `pipetransformer freeze`
(running job, forward only, within the model), before anything is filed in the job's etcd; the
controller then audits it in the store under the signed-in name. A trace request goes through
`edge.overrides.file_trace_request` (`pipetransformer trace`: a running job that times its
stages). Refused sign-ins and refused requests are logged on the dashboard's stderr with the
client address, filed ones with the signed-in name.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TypeVar

import streamlit as st

from pipetransformer.dashboard.auth import (
    HOW_TO_ENABLE,
    AuthConfigError,
    Credentials,
    load_credentials,
    oidc_configured,
)
from pipetransformer.dashboard.launch import Options
from pipetransformer.edge.etcd_client import EtcdClient, EtcdError
from pipetransformer.edge.overrides import (
    OverrideError,
    allowed_layers,
    file_freeze_request,
    file_trace_request,
    live_etcd_endpoint,
    pending_request,
)
from pipetransformer.store import JobInfo, Store

R = TypeVar("R")

ACTOR_KEY = "actor"  # session state: the signed-in user's name
FLASH_KEY = "filed"  # session state: what the last filing said, shown after the rerun
ETCD_TIMEOUT_S = 3.0


def audit_log() -> logging.Logger:
    """The dashboard's audit logger, on stderr with a timestamp (Streamlit configures only its own
    loggers); set up once per server process, whatever the number of reruns."""
    log = logging.getLogger("pipetransformer.dashboard")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    return log


def client_address() -> str:
    try:
        ip = st.context.ip_address
    except (AttributeError, RuntimeError):
        ip = None
    return ip if isinstance(ip, str) and ip else "unknown address"


def _oidc_user() -> str | None:
    """The OIDC-authenticated name when Streamlit's login is configured and used."""
    try:
        if st.user.is_logged_in:
            return str(st.user.get("email") or st.user.get("name") or st.user.get("sub"))
    except (AttributeError, KeyError, RuntimeError):
        pass
    return None


def signed_in() -> str | None:
    return st.session_state.get(ACTOR_KEY) or _oidc_user()


def sign_in_panel() -> str | None:
    """The sidebar's account box; returns the signed-in user's name, or None."""
    log = audit_log()
    box = st.sidebar.container(border=True)
    box.markdown("**Actions**")
    if (oidc_user := _oidc_user()) is not None:
        box.caption(f"Signed in as **{oidc_user}** (OIDC)")
        box.button("Sign out", on_click=st.logout, key="logout")
        return oidc_user
    if actor := st.session_state.get(ACTOR_KEY):
        box.caption(f"Signed in as **{actor}**")
        if box.button("Sign out", key="sign_out"):
            log.info("sign-out: %s from %s", actor, client_address())
            del st.session_state[ACTOR_KEY]
            st.rerun()
        return actor
    try:
        credentials = load_credentials()
    except AuthConfigError as exc:
        box.error(f"Sign-in is misconfigured: {exc}")
        return None
    oidc = oidc_configured()
    if credentials is not None:
        _token_form(box, credentials, log)
    if oidc:
        box.button("Log in with your identity provider", on_click=st.login, key="oidc_login")
    if credentials is None and not oidc:
        box.info(HOW_TO_ENABLE)
    return None


def _token_form(
    box: st.delta_generator.DeltaGenerator, credentials: Credentials, log: logging.Logger
) -> None:
    names = credentials.names
    with box.form("sign_in", clear_on_submit=True, border=False):
        user = st.text_input("User", value=names[0] if len(names) == 1 else "", key="sign_in_user")
        token = st.text_input("Token", type="password", key="sign_in_token")
        submitted = st.form_submit_button("Sign in")
    if not submitted:
        return
    name = credentials.check(user, token)
    if name is None:
        log.warning(
            "refused sign-in: user %r from %s (wrong user or token)", user.strip(), client_address()
        )
        box.error("Sign-in refused: wrong user or token.")
        return
    log.info("sign-in: %s from %s (%s)", name, client_address(), credentials.source)
    st.session_state[ACTOR_KEY] = name
    st.rerun()


@st.cache_resource(show_spinner=False)
def etcd_client(endpoint: str) -> EtcdClient:
    # One client per endpoint for the whole server; calls fail fast when the job's etcd is gone.
    return EtcdClient(endpoint, timeout=ETCD_TIMEOUT_S, retry_timeout=ETCD_TIMEOUT_S)


def job_etcd(job: JobInfo, options: Options) -> EtcdClient | None:
    """The running job's etcd client, or None when it has none (finished, or not found)."""
    if job.state != "running":
        return None
    try:
        return etcd_client(live_etcd_endpoint(job, options.etcd))
    except OverrideError:
        return None


def pending_raw(job: JobInfo, options: Options) -> str | None:
    """The request waiting in the running job's etcd (None when there is none or no etcd)."""
    etcd = job_etcd(job, options)
    if etcd is None:
        return None
    try:
        return pending_request(etcd, job.id)
    except EtcdError:  # down, or refusing this dashboard (TLS, permissions): nothing shown
        return None


def freeze_override_control(
    store: Store, job: JobInfo, options: Options, actor: str | None
) -> None:
    """Choose a new boundary, say why, file it. Disabled (and saying why) without a signed-in
    user or a running job; a refused request says which rule refused it and files nothing."""
    lo, hi = allowed_layers(job, job.freeze_boundary)
    if actor is None:
        why_not = "Sign in (sidebar) to file freeze requests."
    elif job.state != "running":
        why_not = f"The job is {job.state}: freeze requests need a running job."
    elif lo > hi:
        why_not = (
            f"No further freezing: blocks 0..{job.freeze_boundary - 1} are frozen and the last "
            f"{job.spec.freeze.keep_trainable} block(s) stay trainable."
        )
    else:
        why_not = None
    depth = job.spec.model.depth
    # offered first: the lowest boundary a request may ask for, or the one in force where none
    # may be asked for (never a value the rules refuse)
    default = lo if lo <= hi else job.freeze_boundary
    with st.form("freeze_override", border=True):
        # the boundary in force is in the live header ("Frozen"); this form is not redrawn
        st.markdown("**Freeze override** · applied at the job's next decision point")
        layers = st.number_input(
            "New freeze boundary (blocks below it freeze)",
            min_value=0,
            max_value=depth,
            value=default,
            step=1,
            disabled=why_not is not None,
            help=(f"forward only: {lo}..{hi}" if lo <= hi else "no further freezing is allowed")
            + f" (the last {job.spec.freeze.keep_trainable} block(s) stay trainable)",
            key="override_layers",
        )
        reason = st.text_input(
            "Reason (kept in the audit trail)",
            disabled=why_not is not None,
            key="override_reason",
        )
        submitted = st.form_submit_button(
            "File freeze request", disabled=why_not is not None, type="primary"
        )
    if why_not is not None:
        st.caption(why_not)
    if message := st.session_state.pop(FLASH_KEY, None):
        st.success(message)
    if submitted:
        _file(store, job, options, int(layers), reason)


def _file_signed_in(
    kind: str, job: JobInfo, options: Options, file: Callable[[EtcdClient, str], R]
) -> tuple[str, R] | None:
    """File a `kind` request for the signed-in user: `file(etcd, who)` on the job's etcd, `who`
    the user's name marked as the dashboard's. Returns (user, what `file` returned); None when
    refused (no one signed in, a rule, or an etcd that does not answer), said on the page and,
    for a refusal, in the audit log."""
    log = audit_log()
    who = signed_in()
    if who is None:  # a stale form from before a sign-out: refuse, never trust the page
        log.warning(
            "refused %s request for %s from %s: not signed in", kind, job.id, client_address()
        )
        st.error("Refused: sign in first.")
        return None
    try:
        etcd = etcd_client(live_etcd_endpoint(job, options.etcd))
        return who, file(etcd, f"{who} (dashboard)")
    except OverrideError as exc:
        log.warning("refused %s request by %s for %s: %s", kind, who, job.id, exc)
        st.error(f"Refused: {exc}")
    except EtcdError as exc:  # down, or refusing this dashboard's identity
        st.error(f"The job's etcd did not take the request: {exc}")
    return None


def _file(store: Store, job: JobInfo, options: Options, layers: int, reason: str) -> None:
    filed = _file_signed_in(
        "freeze",
        job,
        options,
        lambda etcd, who: file_freeze_request(etcd, job, layers, reason, who=who),
    )
    if filed is None:
        return
    who, request = filed
    audit_log().info(
        "freeze request %s by %s for %s: layers=%d (%s)", request.id, who, job.id, layers, reason
    )
    # rerun the whole page, so the request list above shows it at once; the message survives
    st.session_state[FLASH_KEY] = (
        f"Request {request.id} filed: freeze blocks 0..{layers - 1} at the next decision point."
    )
    st.rerun()


TRACE_FLASH_KEY = "trace_flash"  # session state: what the last capture said, after the rerun
# session state: {job id: trace request id} a capture from this page waits for; the Pipeline
# view shows that trace once the ranks have reported it (`awaited_trace`)
TRACE_AWAITED_KEY = "trace_awaited"


def awaited_trace(job_id: str) -> str | None:
    """The trace request a capture from this page filed for `job_id` and still waits for."""
    return st.session_state.get(TRACE_AWAITED_KEY, {}).get(job_id)


def trace_arrived(job_id: str) -> None:
    """The awaited trace of `job_id` is in the store: stop waiting for it."""
    st.session_state.get(TRACE_AWAITED_KEY, {}).pop(job_id, None)


def trace_control(job: JobInfo, options: Options, actor: str | None) -> None:
    """A button that asks every rank of the running job to trace its next step after a control
    point (`edge.overrides.file_trace_request`, the same rules as `pipetransformer trace`; a
    signed-in user's, audited like a freeze request). Nothing for a job that is not running;
    without a signed-in user, or for a job that times nothing (`runtime.stage_timing: false`),
    it says why there is no button. A refused request says why, never with a traceback."""
    if job.state != "running":
        trace_arrived(job.id)  # it will never come
        return  # nothing to trace: the captured traces above are what there is
    if actor is None:
        st.caption("Sign in (sidebar) to capture the next step's schedule on every rank.")
        return
    if not job.spec.runtime.stage_timing:
        st.caption(
            "This job runs with `runtime.stage_timing: false`: its ranks time nothing, so there "
            "is no step to capture."
        )
        return
    if message := st.session_state.pop(TRACE_FLASH_KEY, None):
        st.success(message)
    if not st.button("Capture the next step", key="capture_trace"):
        return
    filed = _file_signed_in(
        "trace", job, options, lambda etcd, who: file_trace_request(etcd, job, who=who)
    )
    if filed is None:
        return
    who, request = filed
    log = audit_log()
    every = job.spec.runtime.control_every_steps
    if request.who == f"{who} (dashboard)":
        log.info("trace request %s by %s for %s", request.id, who, job.id)
        filed = f"Trace request {request.id} filed"
    else:  # one still pending is shared: the same trace answers both
        log.info("trace request %s by %s for %s: joins %s's", request.id, who, job.id, request.who)
        filed = (
            f"Trace request {request.id} (by {request.who}) was already pending: it is yours too"
        )
    st.session_state.setdefault(TRACE_AWAITED_KEY, {})[job.id] = request.id
    st.session_state[TRACE_FLASH_KEY] = (
        f"{filed}. Every rank traces the step after its next control point, at most {every} "
        "step(s) away (`runtime.control_every_steps`); the trace shows up above by itself once "
        "they report."
    )
    st.rerun()
