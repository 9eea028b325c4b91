#!/bin/sh
set -e
for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done
