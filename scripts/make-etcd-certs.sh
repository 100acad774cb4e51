#!/usr/bin/env bash
# Make the certificates etcd and its clients use (k8s/README.md, "etcd: TLS and roles"): one CA,
# the members' certificate (serving clients and each other) and one client certificate per role.
#
#   scripts/make-etcd-certs.sh OUT_DIR [NAMESPACE]      (NAMESPACE default: pipetransformer)
#
# OUT_DIR/ca.crt, ca.key                 the CA (keep ca.key off the cluster: it mints identities)
# OUT_DIR/<secret>/{ca.crt,tls.crt,tls.key}  one folder per Secret, as cert-manager lays them out:
#   etcd-member-tls          the etcd members: serving certificate for the Services etcd and
#                            etcd-peers (and localhost, for etcdctl inside a member), and the
#                            certificate the members present to each other (CN etcd-peer: the
#                            members accept no other peer CN)
#   etcd-client-root         CN root: `pipetransformer etcd-auth setup` (Job pipetransformer-etcd-auth)
#   etcd-client-controller   CN pipetransformer-controller: the jobs' controller pods
#   etcd-client-dashboard    CN pipetransformer-dashboard: the dashboard, people's `freeze`/`trace`
#   etcd-client-trainer      CN pipetransformer-trainer: the trainer pods' TLS handshake; no etcd
#                            user has that name, their identity is the job's user and password
#
# etcd takes a client's user from its certificate's CN (--client-cert-auth), so these CNs are
# the user names orchestrator/etcd_auth.py creates; keep them in step.
# Environment: DAYS (default 825) for every certificate but the CA (3650), EXTRA_SANS (comma
# separated, e.g. "DNS:etcd.example.com,IP:10.0.0.5") added to the members' certificate.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ "${1:0:1}" = "-" ]; then
  echo "usage: $0 OUT_DIR [NAMESPACE]" >&2
  exit 2
fi
out=$1
ns=${2:-pipetransformer}
days=${DAYS:-825}
if ! [[ "$ns" =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]]; then
  echo "$0: NAMESPACE '$ns' is not a Kubernetes namespace name" >&2
  exit 2
fi
if ! [[ "$days" =~ ^[1-9][0-9]*$ ]]; then
  echo "$0: DAYS='$days' must be a positive number of days" >&2
  exit 2
fi
command -v openssl >/dev/null || { echo "$0: openssl is not installed" >&2; exit 2; }
umask 077 # the keys: readable by their owner only
mkdir -p "$out"

# P-256 keys: small, fast, and what gRPC's BoringSSL and etcd's Go TLS both accept
newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)

if [ -f "$out/ca.crt" ] && [ -f "$out/ca.key" ]; then
  echo "using the CA in $out (ca.crt, ca.key)"
else
  openssl req -x509 "${newkey[@]}" -keyout "$out/ca.key" -out "$out/ca.crt" -days 3650 \
    -subj "/CN=pipetransformer-etcd-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  echo "made the CA: $out/ca.crt"
fi

# issue SECRET CN EXTENDED_KEY_USAGE [SUBJECT_ALT_NAMES]
issue() {
  local dir="$out/$1" cn=$2 eku=$3 sans=${4:-}
  mkdir -p "$dir"
  local ext="$dir/extensions.cnf"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [ -z "$sans" ] || echo "subjectAltName=$sans"
  } >"$ext"
  openssl req -new "${newkey[@]}" -keyout "$dir/tls.key" -out "$dir/tls.csr" -subj "/CN=$cn" \
    2>/dev/null
  openssl x509 -req -in "$dir/tls.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -CAserial "$out/ca.srl" -days "$days" -extfile "$ext" \
    -out "$dir/tls.crt" 2>/dev/null
  cp "$out/ca.crt" "$dir/ca.crt"
  rm -f "$dir/tls.csr" "$ext"
  echo "made $dir (CN $cn)"
}

# The members: clients reach them as etcd (the Service) or by member name through etcd-peers;
# members reach each other by member name. serverAuth for both, clientAuth for dialing peers.
sans="DNS:etcd,DNS:etcd.$ns,DNS:etcd.$ns.svc,DNS:etcd.$ns.svc.cluster.local"
sans+=",DNS:etcd-peers,DNS:etcd-peers.$ns.svc,DNS:*.etcd-peers.$ns.svc"
sans+=",DNS:*.etcd-peers.$ns.svc.cluster.local,DNS:localhost,IP:127.0.0.1"
[ -z "${EXTRA_SANS:-}" ] || sans+=",$EXTRA_SANS"
issue etcd-member-tls etcd-peer serverAuth,clientAuth "$sans"

issue etcd-client-root root clientAuth
issue etcd-client-controller pipetransformer-controller clientAuth
issue etcd-client-dashboard pipetransformer-dashboard clientAuth
issue etcd-client-trainer pipetransformer-trainer clientAuth
