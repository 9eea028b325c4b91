#!/bin/sh
set -e
sort -u names.txt > unique.txt
