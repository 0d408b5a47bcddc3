// The single Boost.Test runner for every lgreco unit suite (`make test`).
#define BOOST_TEST_MODULE lgreco
#include <boost/test/unit_test.hpp>
