#!/bin/sh
set -e
chmod u+x scripts/run.sh && chmod 600 data/secret.txt
