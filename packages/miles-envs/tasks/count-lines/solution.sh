#!/bin/sh
set -e
wc -l < data/log.txt | tr -d ' ' > count.txt
