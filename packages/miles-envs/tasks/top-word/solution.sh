#!/bin/sh
set -e
tr -s '[:space:]' '\n' < text.txt | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c | sort -rn | head -n 1 | awk '{print $2}' > top.txt
