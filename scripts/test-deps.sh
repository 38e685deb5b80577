#!/usr/bin/env bash
# test-deps.sh installs what the tests need beyond the build, from Debian's packages:
# promtool (the prometheus package) to lint /metrics, and curl and python3, which
# scripts/bench-router uses (cmd/shoal's smoke run of it). It does nothing when they
# are present.
set -euo pipefail
pkgs=()
command -v promtool >/dev/null 2>&1 || pkgs+=(prometheus)
command -v curl >/dev/null 2>&1 || pkgs+=(curl)
command -v python3 >/dev/null 2>&1 || pkgs+=(python3)
if [ "${#pkgs[@]}" = 0 ]; then
	exit 0
fi
echo "test-deps: installing Debian's ${pkgs[*]} (metrics lint in the api tests, the bench-router smoke run)" >&2
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
$sudo apt-get update -qq >&2
# No service is started: policy-rc.d is honoured and containers have no init.
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2
