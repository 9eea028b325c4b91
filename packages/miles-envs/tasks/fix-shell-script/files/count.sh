#!/bin/sh
ls -a "$1" | wc -l
