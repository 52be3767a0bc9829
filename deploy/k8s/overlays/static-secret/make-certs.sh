#!/usr/bin/env bash
# Makes the certificates the static-secret overlay packs into the yatt-certs Secret:
#   deploy/k8s/overlays/static-secret/make-certs.sh [REPLICAS]   (default 2)
# The CA (ca.key) is kept in certs-ca/ beside this script; keep it private.
# With more replicas, add their files to kustomization.yaml's secretGenerator.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
replicas=${1:-2}
YATT_NODE_BIN=${YATT_NODE_BIN:-yatt-node}
ca="$here/certs-ca"
out="$here/certs"
mkdir -p "$out"
[ -f "$ca/ca.key" ] || "$YATT_NODE_BIN" init --dir "$ca" >/dev/null
for ((k = 0; k < replicas; k++)); do
  "$YATT_NODE_BIN" cert --ca-dir "$ca" --name "yatt-node-$k" --kind node --out "$out" >/dev/null
done
"$YATT_NODE_BIN" cert --ca-dir "$ca" --name train --kind trainer --out "$out" >/dev/null
echo "certificates for $replicas pods and the trainer in $out"
