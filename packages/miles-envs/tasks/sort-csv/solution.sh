#!/bin/sh
set -e
head -n 1 people.csv > sorted.csv && tail -n +2 people.csv | sort -t, -k2,2n >> sorted.csv
