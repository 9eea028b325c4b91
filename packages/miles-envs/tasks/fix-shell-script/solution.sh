#!/bin/sh
set -e
printf '#!/bin/sh\nfind "$1" -maxdepth 1 -type f | wc -l\n' > count.sh
