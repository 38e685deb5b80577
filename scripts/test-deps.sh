#!/usr/bin/env bash
# test-deps.sh installs what the tests need beyond the build: promtool (Debian's
# prometheus package) to lint /metrics. It does nothing when promtool is present.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
	exit 0
fi
echo "test-deps: installing Debian's prometheus package for promtool (metrics lint in the api tests)" >&2
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
$sudo apt-get update -qq >&2
# No service is started: policy-rc.d is honoured and containers have no init.
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >&2
