/* Creating the library's temporary files (checkpoint rank files, manifests, exports, NCCL id
 * files) where somebody else may write into the directory.
 *
 * A temporary under a fixed name that is opened with O_CREAT | O_TRUNC writes through whatever
 * is planted there: a symbolic link to any file the job may write (the job often runs as root)
 * would get our bytes, and the rename afterwards would leave the final name a link to it. So a
 * temporary is always a new file: O_CREAT | O_EXCL refuses any existing name (a symbolic link
 * included, wherever it points), and O_NOFOLLOW says so once more. A regular file under the
 * name is what a crashed writer leaves behind: it is removed (unlink removes a name, never
 * what a link points to) and the create tried again, so a stale temporary never blocks the
 * next save. Anything else there (a link, a FIFO, a device, a directory) is left alone and
 * refused: somebody put it there on purpose. */
#define _POSIX_C_SOURCE 200809L /* O_NOFOLLOW, O_CLOEXEC, lstat */

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sg_core.h" /* sg__file_create */

static int create_excl(const char *path, int mode) {
  return open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC,
              (mode_t)mode);
}

int sg__file_create(const char *path, int mode, int *fd, int *removed_stale) {
  *fd = -1;
  if (removed_stale) *removed_stale = 0;
  for (int attempt = 0; attempt < 2; attempt++) {
    const int f = create_excl(path, mode);
    if (f >= 0) {
      /* O_NONBLOCK only kept the open itself from waiting; regular files ignore it. */
      const int fl = fcntl(f, F_GETFL);
      if (fl != -1) (void)fcntl(f, F_SETFL, fl & ~O_NONBLOCK);
      *fd = f;
      return 0;
    }
    if (errno != EEXIST) return errno;
    struct stat s;
    if (lstat(path, &s) != 0) {
      if (errno == ENOENT) continue; /* removed meanwhile */
      return errno;
    }
    if (!S_ISREG(s.st_mode)) return EEXIST;
    if (unlink(path) != 0 && errno != ENOENT) return errno;
    if (removed_stale) *removed_stale = 1;
  }
  return EEXIST; /* recreated after we removed it: another writer is at work */
}

const char *sg__file_exists_why(const char *path) {
  struct stat s;
  if (lstat(path, &s) != 0) return "it was created again by someone else meanwhile";
  if (S_ISLNK(s.st_mode)) return "it is a symbolic link (links are never followed there)";
  if (S_ISDIR(s.st_mode)) return "it is a directory";
  if (S_ISREG(s.st_mode)) return "it was created again by someone else meanwhile";
  return "it is not a regular file (a FIFO, a socket or a device)";
}
