#!/usr/bin/env bash
# Installs headless Chromium (Debian packages chromium + chromium-driver) when /usr/bin/chromium
# is missing. Only the browser test of the HTML report needs it
# (tests/test_plots_report.py::test_report_renders_in_headless_chromium, marked slow).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo ".ci/chromium.sh: /usr/bin/chromium is missing and installing it needs root (or sudo)" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y chromium chromium-driver
/usr/bin/chromium --version
