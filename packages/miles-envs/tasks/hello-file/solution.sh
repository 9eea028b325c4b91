#!/bin/sh
set -e
printf 'Hello, world!\n' > hello.txt
