#!/bin/sh
set -e
grep -rl foo src | while read -r f; do sed -i 's/foo/bar/g' "$f"; done
