#!/usr/bin/env bash
# Session 33's last device call, for an H200 only (an H100's figures came in calls 1-4):
# decode against cuDNN and on an fp8 cache (issue 13 reqs 3 and 5), then bench/prefill.py
# (reqs 1 and 2). On an H100 it stops at once.
#   KEEP_R=1 bash bench/session33d.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
[ "$tag" = h200 ] || { echo "not an H200: nothing to do"; session_end; }
session_h200_rows
session_end
