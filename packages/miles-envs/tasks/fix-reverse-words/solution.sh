#!/bin/sh
set -e
sed -i 's/return " ".join(s.split())/return " ".join(reversed(s.split()))/' words.py
