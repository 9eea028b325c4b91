#!/bin/sh
set -e
tr -d '\r' < dos.txt > dos.tmp && mv dos.tmp dos.txt
