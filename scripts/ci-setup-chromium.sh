#!/bin/sh
# Install Debian's headless Chromium for the HTML report's screenshot test
# (tests/docs/test_loadgen_html.py), which fails rather than skips when CI=true and it is missing.
# Idempotent: does nothing when /usr/bin/chromium exists. Needs root (or sudo) and apt.
set -eu

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
else
    SUDO="sudo"
fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium
/usr/bin/chromium --version
