#!/bin/sh
set -e
mkdir -p project/src project/tests && : > project/README.md
