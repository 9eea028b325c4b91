#!/bin/sh
set -e
ls -S data | head -n 1 > largest.txt
