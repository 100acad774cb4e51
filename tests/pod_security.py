"""Kubernetes' Pod Security Standards, "restricted" profile (which includes "baseline"), as the
published rules state them (kubernetes.io/docs/concepts/security/pod-security-standards, v1.30),
checked on a pod spec: what a namespace labelled `pod-security.kubernetes.io/enforce: restricted`
would refuse. No API server can run here, so this is the check the admission plugin would make."""

from __future__ import annotations

from typing import Any

ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {
    None,
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        *pod.get("initContainers", []),
        *pod.get("containers", []),
        *pod.get("ephemeralContainers", []),
    ]


def _selinux(where: str, options: dict[str, Any] | None) -> list[str]:
    if not options:
        return []
    out = []
    if options.get("type") not in SELINUX_TYPES:
        out.append(f"{where}: seLinuxOptions.type {options['type']!r} is not allowed")
    if options.get("user") or options.get("role"):
        out.append(f"{where}: seLinuxOptions.user and .role must be unset")
    return out


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every rule of the restricted profile `pod` (a PodSpec as JSON) breaks, one line each."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"pod: {field} must be unset or false")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod: windowsOptions.hostProcess must be unset or false")
    out += _selinux("pod", psc.get("seLinuxOptions"))
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"pod: sysctl {sysctl.get('name')!r} is not in the safe set")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"pod: volume {volume['name']!r} is of type {', '.join(sorted(kinds))}")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        out.append("pod: seccompProfile.type must not be Unconfined")
    if (psc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append("pod: appArmorProfile.type must not be Unconfined")
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser must not be 0")
    for c in _containers(pod):
        at = f"container {c.get('name')}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{at}: privileged must be unset or false")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{at}: windowsOptions.hostProcess must be unset or false")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{at}: procMount must be Default")
        out += _selinux(at, sc.get("seLinuxOptions"))
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"{at}: appArmorProfile.type must not be Unconfined")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{at}: hostPort must be unset or 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{at}: allowPrivilegeEscalation must be false")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{at}: runAsNonRoot must be true (on the pod or the container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{at}: runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in SECCOMP_OK:
            out.append(f"{at}: seccompProfile.type must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{at}: capabilities.drop must include ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(
                f"{at}: capabilities.add may hold only NET_BIND_SERVICE, not {sorted(extra)}"
            )
    return out
